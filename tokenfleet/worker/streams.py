"""Redis Streams plumbing of the worker: consumer groups, bounded reads, the outbox of replies.

Everything the worker writes for one step (token events, terminal events, acknowledgements,
dead letters) is queued in an :class:`Outbox` and sent pipelined. While a batch runs on a plain
Redis server, the outbox, the read of new work and the read of cancels share one round trip per
step (:meth:`Outbox.queue_into`, :meth:`StreamReader.queue_read`); on a cluster, whose pipelines
do not keep order across nodes, the outbox goes first and acknowledgements after its events.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import redis

from tokenfleet import protocol
from tokenfleet.protocol import GROUP, Keys

log = logging.getLogger(__name__)

# Reads up to ARGV[3] new entries in total across KEYS, in KEYS order: one round trip, and the
# "no hoarding" bound holds exactly (plain XREADGROUP's COUNT applies per stream).
_READ_BOUNDED = """
local remaining = tonumber(ARGV[3])
local out = {}
for _, key in ipairs(KEYS) do
  if remaining <= 0 then break end
  local res = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', remaining, 'STREAMS', key, '>')
  if res then
    local entries = res[1][2]
    remaining = remaining - #entries
    table.insert(out, {key, entries})
  end
end
return out
"""


# One step's writes in one atomic call: KEYS[k] is the key of the k-th command, and ARGV holds,
# for each in turn, its name, its argument count and its arguments. Every command runs (pcall);
# the errors come back as {k, message, ...}, e.g. a copy of an event refused at its fixed id.
_PUBLISH = """
local errors = {}
local a = 1
for k = 1, #KEYS do
  local n = tonumber(ARGV[a + 1])
  local reply = redis.pcall(ARGV[a], KEYS[k], unpack(ARGV, a + 2, a + 1 + n))
  if type(reply) == 'table' and reply.err then
    errors[#errors + 1] = k
    errors[#errors + 1] = reply.err
  end
  a = a + 2 + n
end
return errors
"""


# Drops the entries every consumer of the group has acknowledged, and nothing else: those older
# than the oldest pending entry, or, with nothing pending, all up to the last delivered one.
_TRIM_ACKED = """
local pending = redis.call('XPENDING', KEYS[1], ARGV[1])
local minid
if pending[1] > 0 then
  minid = pending[2]
else
  local last
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    local name, delivered
    for i = 1, #g, 2 do
      if g[i] == 'name' then name = g[i + 1] end
      if g[i] == 'last-delivered-id' then delivered = g[i + 1] end
    end
    if name == ARGV[1] then last = delivered end
  end
  if not last or last == '0-0' then return 0 end
  local ms, seq = string.match(last, '(%d+)-(%d+)')
  minid = ms .. '-' .. (tonumber(seq) + 1)
end
return redis.call('XTRIM', KEYS[1], 'MINID', minid)
"""


@dataclass(frozen=True)
class Entry:
    """One request stream entry as read."""

    stream: str
    entry_id: str
    fields: dict[bytes, bytes]

    @property
    def enqueued_wall(self) -> float:
        """Wall-clock time Redis accepted the entry (the millisecond part of its id)."""
        return int(self.entry_id.split("-", 1)[0]) / 1000.0


def _decode_fields(flat: list) -> dict[bytes, bytes]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}


class StreamReader:
    """Reads new entries for one consumer from several request streams, fairly and bounded."""

    def __init__(self, client: redis.Redis, streams: list[str], consumer: str):
        self.client = client
        self.streams = streams
        self.consumer = consumer
        self._script = client.register_script(_READ_BOUNDED)
        self._trim = client.register_script(_TRIM_ACKED)
        self._rotation = itertools.cycle(range(len(streams)))

    def ensure_groups(self) -> None:
        """Create the consumer group on every stream; from id 0 so that requests enqueued before
        any worker existed are served."""
        for stream in self.streams:
            try:
                self.client.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def read_own_pending(self, count: int) -> list[Entry]:
        """Entries this consumer name was given before and never acknowledged (a worker restarted
        under a fixed ``--name``): read from id 0, as a restarted consumer must."""
        resp = self.client.xreadgroup(GROUP, self.consumer, {s: "0" for s in self.streams}, count=count)
        return [
            Entry(stream.decode(), entry_id.decode(), fields)
            for stream, items in resp or []
            for entry_id, fields in items
            if fields  # entries deleted while pending come back empty
        ]

    def trim_acknowledged(self) -> int:
        """Remove acknowledged entries from every stream (never an unacknowledged one), so Redis
        memory stays bounded on a long run; returns how many were removed."""
        return sum(int(self._trim(keys=[stream], args=[GROUP])) for stream in self.streams)

    def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to ``count`` new entries. With ``block_ms``, wait that long for the first one (that
        wait reads at most one entry per stream); the rest is read without waiting. Streams are
        visited from a rotating start so that a busy stream cannot starve a quiet one."""
        if count <= 0:
            return []
        entries: list[Entry] = []
        if block_ms is not None:
            resp = self.client.xreadgroup(
                GROUP, self.consumer, {s: ">" for s in self.streams}, count=1, block=max(1, block_ms)
            )
            for stream, items in resp or []:
                for entry_id, fields in items:
                    entries.append(Entry(stream.decode(), entry_id.decode(), fields))
            if not entries:
                return []
        remaining = count - len(entries)
        if remaining > 0:
            entries += self._parse(self._script(keys=self._order(), args=[GROUP, self.consumer, remaining]))
        return entries

    def queue_read(self, pipe: redis.client.Pipeline, count: int) -> None:
        """Queue :meth:`read`'s non-blocking read on ``pipe``; :meth:`parse_queued` reads its reply
        (the script by its SHA: a script call through a pipeline would cost a SCRIPT EXISTS
        round trip of its own)."""
        order = self._order()
        pipe.evalsha(self._script.sha, len(order), *order, GROUP, self.consumer, count)

    def parse_queued(self, reply: object, count: int) -> list[Entry]:
        """The entries of a :meth:`queue_read` reply; if Redis had lost the script (a restart), the
        read is made again on its own, which loads it."""
        if isinstance(reply, redis.exceptions.NoScriptError):
            return self.read(count, None)
        if isinstance(reply, Exception):
            raise reply
        return self._parse(reply)

    def _order(self) -> list[str]:
        start = next(self._rotation)
        return self.streams[start:] + self.streams[:start]

    @staticmethod
    def _parse(reply) -> list[Entry]:
        return [
            Entry(stream.decode(), entry_id.decode(), _decode_fields(flat))
            for stream, items in reply
            for entry_id, flat in items
        ]


class Outbox:
    """What one step writes, sent in one round trip (or two, on a cluster).

    Replies and dead letters go first; acknowledgements only after them, so a request is never
    acknowledged without its terminal event. On one server all of it runs as one call of a small
    script: atomically, so Redis wakes a client blocked on many reply streams once, after the last
    of them, not once per event it was waiting on (a client following 32 requests read 6-7 times
    a step); and as one command, whose packing and reply cost the worker a fraction of a command
    per event. Across Redis Cluster slots a script cannot run: plain pipelines, writes then
    acknowledgements. Retrying after a lost connection is safe because reply events sit at fixed
    ids (a copy is refused) and XACK is idempotent.
    """

    def __init__(self, client: redis.Redis, keys: Keys):
        self.client = client
        self.keys = keys
        self.atomic = not isinstance(client, redis.RedisCluster)
        self._publish = client.register_script(_PUBLISH) if self.atomic else None
        self._writes: list[tuple[str, tuple, dict]] = []
        self._acks: list[tuple[str, tuple, dict]] = []
        # what queue_into handed to a pipeline that has not answered yet (writes, acks)
        self._in_flight: tuple[list, list] | None = None

    def __len__(self) -> int:
        flying = sum(map(len, self._in_flight)) if self._in_flight else 0
        return len(self._writes) + len(self._acks) + flying

    def event(self, request_id: str, event: dict, ttl_s: int | None = None) -> None:
        """Append a reply event at its fixed id (a copy already there is refused by Redis);
        ``ttl_s`` (re)sets the reply stream's expiry."""
        key = self.keys.reply_stream(request_id)
        self._writes.append(("xadd", (key, protocol.encode_event(event)), {"id": protocol.event_id(event)}))
        if ttl_s is not None:
            self._writes.append(("expire", (key, ttl_s), {}))

    def ack(self, stream: str, entry_id: str) -> None:
        self._acks.append(("xack", (stream, GROUP, entry_id), {}))

    def dead_letter(self, entry: Entry, code: str, reason: str, worker: str) -> None:
        """Record an entry that cannot be served, with the reason; the stream keeps about
        :data:`~tokenfleet.protocol.DEAD_LETTER_MAXLEN` entries of at most
        :data:`~tokenfleet.protocol.DEAD_LETTER_BODY_BYTES` of body each (Redis memory stays
        bounded however much bad input arrives; ``body_bytes`` says how large it was)."""
        body = protocol.pack(entry.fields)
        fields = {
            b"stream": entry.stream,
            b"entry": entry.entry_id,
            b"code": code,
            b"reason": reason[:1000],
            b"worker": worker,
            b"at": str(time.time()),
            b"body": body[: protocol.DEAD_LETTER_BODY_BYTES],
            b"body_bytes": str(len(body)),
        }
        dead = self.keys.dead_letter
        self._writes.append(
            ("xadd", (dead, fields), {"maxlen": protocol.DEAD_LETTER_MAXLEN, "approximate": True})
        )

    def move(self, entry: Entry, to_stream: str, fields: dict[bytes, bytes]) -> None:
        """Re-enqueue an entry on another stream, then acknowledge it here. A crash in between
        leaves both: the request may be served twice, and fixed reply ids keep its replies single."""
        self._acks.append(("xadd", (to_stream, fields), {}))
        self.ack(entry.stream, entry.entry_id)

    def flush(self) -> list[Exception]:
        """Send everything now (see :meth:`queue_into` to share another round trip). On a
        connection error what is left stays queued for a retry; commands Redis refused (e.g. a
        reply key that a client overwrote with another type) are returned, not retried."""
        self.restore()
        if not len(self):
            return []
        if self.atomic:
            try:  # redis-py's Script loads the script if Redis lost it (a restart)
                reply = self._publish(*_script_form(self._writes + self._acks))
            except redis.ResponseError as e:
                self._without_scripts(e)
            else:
                self._writes, self._acks = [], []
                return _refused(_script_errors(reply))
        errors: list[Exception] = []
        for queue in (self._writes, self._acks):
            if not queue:
                continue
            pipe = self.client.pipeline(transaction=False)
            for name, args, kwargs in queue:
                getattr(pipe, name)(*args, **kwargs)
            results = pipe.execute(raise_on_error=False)
            queue.clear()
            errors += _refused(results)
        return errors

    def queue_into(self, pipe: redis.client.Pipeline) -> int:
        """Queue everything on ``pipe``, writes before acknowledgements (one script call on one
        server), to share another round trip; returns how many replies that adds, which go to
        :meth:`sent`. The commands leave the queues (events added meanwhile queue behind them)
        until :meth:`sent` confirms them or :meth:`restore` puts them back in front: if the
        connection drops first, none of it ran."""
        self.restore()
        if not len(self):
            return 0
        writes, acks = self._in_flight = (self._writes, self._acks)
        self._writes, self._acks = [], []
        if self.atomic:
            keys, args = _script_form(writes + acks)
            pipe.evalsha(self._publish.sha, len(keys), *keys, *args)
            return 1
        for name, args, kwargs in writes + acks:
            getattr(pipe, name)(*args, **kwargs)
        return len(writes) + len(acks)

    def sent(self, results: list) -> list[Exception]:
        """After :meth:`queue_into`'s pipeline ran: drop what it carried, return what Redis
        refused. If Redis had lost the script (a restart) or refuses scripts, nothing ran: it goes
        again now, by :meth:`flush`."""
        if self.atomic and results:
            reply = results[0]
            if isinstance(reply, redis.ResponseError):  # nothing ran
                if not isinstance(reply, redis.exceptions.NoScriptError):
                    self._without_scripts(reply)
                return self.flush()
            errors = _refused([reply] if isinstance(reply, Exception) else _script_errors(reply))
        else:
            errors = _refused(results)
        self._in_flight = None
        return errors

    def restore(self) -> None:
        """Put what a failed (or abandoned) :meth:`queue_into` carried back in front of the
        queues, for a retry."""
        if self._in_flight is None:
            return
        writes, acks = self._in_flight
        self._writes, self._acks = writes + self._writes, acks + self._acks
        self._in_flight = None

    def _without_scripts(self, error: Exception) -> None:
        """A server or user that refuses the script: plain pipelines from now on, writes before
        acknowledgements, not atomic."""
        log.warning("redis refused the publish script (%s): replies go in plain pipelines from now on", error)
        self.atomic = False


def _script_form(commands: list[tuple[str, tuple, dict]]) -> tuple[list, list]:
    """KEYS and ARGV of :data:`_PUBLISH` for the outbox's commands (XADD, EXPIRE, XACK)."""
    keys: list = []
    args: list = []
    for name, cargs, kwargs in commands:
        if name == "xadd":
            key, fields = cargs
            rest = [kwargs.get("id", "*")]
            for field, value in fields.items():
                rest += [field, value]
        else:  # EXPIRE key seconds, XACK stream group id
            key, *rest = cargs
        keys.append(key)
        args += [name, len(rest), *rest]
    return keys, args


def _script_errors(reply: list) -> list[Exception]:
    """The commands :data:`_PUBLISH` reported refused, as the errors a pipeline would return."""
    return [
        redis.ResponseError(message.decode() if isinstance(message, bytes) else str(message))
        for message in reply[1::2]
    ]


def _refused(results: list) -> list[Exception]:
    """Errors among pipeline replies: connection errors raise; refused duplicates of reply events
    are dropped (a retry after a lost connection re-sends events already stored)."""
    errors = []
    for result in results:
        if isinstance(result, (redis.ConnectionError, redis.TimeoutError)):
            raise result
        if isinstance(result, Exception) and not protocol.is_duplicate_event_error(result):
            errors.append(result)
    return errors
