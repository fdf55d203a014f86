// A tokenfleet producer in Node.js, written from docs/PROTOCOL.md alone.
//   const client = new TokenfleetClient();                // REDIS_URL, TOKENFLEET_PREFIX
//   const id = await client.submit("Hello", { max_new_tokens: 32 });
//   for await (const ev of client.stream(id)) process.stdout.write(ev.text);
import { randomUUID } from "node:crypto";
import { decode, encode } from "@msgpack/msgpack";
import Redis from "ioredis";

export class RequestFailed extends Error {
  constructor(id, code, message) {
    super(`request ${id} failed: ${code}: ${message}`);
    this.code = code;
  }
}

export class TokenfleetClient {
  constructor({ url = process.env.REDIS_URL ?? "redis://127.0.0.1:6379/0",
                prefix = process.env.TOKENFLEET_PREFIX ?? "tokenfleet" } = {}) {
    this.redis = new Redis(url);
    this.prefix = prefix;
  }

  // Without a tokenizer we use the auto stream: a worker tokenizes and routes the request.
  async submit(prompt, params = {}) {
    const { id = randomUUID().replaceAll("-", ""), ...rest } = params;
    const body = encode({ v: 1, id, prompt, ...rest });
    await this.redis.xadd(`{${this.prefix}}:req:auto`, "*", "m", Buffer.from(body));
    return id;
  }

  // Yields token events ({index, ids, text}) live; returns the done event; throws on error.
  async *stream(id, { blockMs = 1000, timeoutMs = 120000 } = {}) {
    const key = `${this.prefix}:reply:${id}`;
    const deadline = Date.now() + timeoutMs;
    let last = "0";
    while (Date.now() < deadline) {
      const reply = await this.redis.xreadBuffer("BLOCK", blockMs, "STREAMS", key, last);
      if (!reply) continue;
      for (const [entryId, fields] of reply[0][1]) {
        last = entryId.toString();
        const event = decode(fields[fields.findIndex((f) => f.toString() === "m") + 1]);
        if (event.type === "token") yield event;
        else if (event.type === "done") return event;
        else if (event.type === "error") throw new RequestFailed(id, event.code, event.message);
      }
    }
    throw new Error(`no terminal event for ${id} within ${timeoutMs} ms`);
  }

  async result(id, options) {
    const ids = [];
    let text = "";
    const it = this.stream(id, options);
    for (;;) {
      const { value, done } = await it.next();
      if (done) return { id, ids, text, finish_reason: value.finish_reason, usage: value.usage };
      ids.push(...value.ids);
      text += value.text;
    }
  }

  async cancel(id) {
    await this.redis.set(`${this.prefix}:cancel:${id}`, 1, "EX", 86400);
    await this.redis.xadd(`{${this.prefix}}:cancels`, "MAXLEN", "~", 100000, "*", "id", id);
  }

  async close() {
    await this.redis.quit();
  }
}
