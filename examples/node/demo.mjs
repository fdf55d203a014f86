// node demo.mjs "prompt" [max_new_tokens]: streams the text, then prints the result as JSON.
import { TokenfleetClient } from "./tokenfleet.mjs";

const client = new TokenfleetClient();
const prompt = process.argv[2] ?? "Hello from Node";
const maxNew = Number(process.argv[3] ?? 16);
const id = await client.submit(prompt, { max_new_tokens: maxNew, ignore_eos: true });
const ids = [];
let text = "";
const stream = client.stream(id);
let done;
for (;;) {
  const step = await stream.next();
  if (step.done) { done = step.value; break; }
  ids.push(...step.value.ids);
  text += step.value.text;
  process.stderr.write(step.value.text);
}
process.stderr.write("\n");
console.log(JSON.stringify({ id, ids, text, finish_reason: done.finish_reason, usage: done.usage }));
await client.close();
