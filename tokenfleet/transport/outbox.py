"""Everything the worker writes: reply events, acknowledgements, dead letters, moves.

What one step writes is queued here and sent in one round trip (or two, on a cluster). Replies and
dead letters go first and acknowledgements only after them, so a request is never acknowledged
without its terminal event.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from redis.commands.core import Script

from tokenfleet import protocol
from tokenfleet.protocol import GROUP, Keys, Refusal, ReplyEvent
from tokenfleet.transport import scripts
from tokenfleet.transport.intake import Entry

log = logging.getLogger(__name__)

Command = tuple[str, tuple[Any, ...], dict[str, Any]]


class Outbox:
    """What one step writes, sent in one round trip (or two, on a cluster).

    Replies and dead letters go first; acknowledgements only after them, so a request is never
    acknowledged without its terminal event. On one server all of it runs as one call of a small
    script: atomically, so Redis wakes a client blocked on many reply streams once, after the last
    of them, not once per event it was waiting on; and as one command, which the worker packs and
    parses once. Across Redis Cluster slots a script cannot run: plain pipelines, writes then
    acknowledgements. Retrying after a lost connection is safe because reply events sit at fixed
    ids (a copy is refused) and XACK is idempotent.
    """

    def __init__(self, client: redis.Redis, keys: Keys):
        self.client = client
        self.keys = keys
        # the publish script, while this server runs it (a cluster cannot: its keys span slots)
        self._publish: Script | None = None
        if not isinstance(client, redis.RedisCluster):
            self._publish = client.register_script(scripts.PUBLISH)
        self._writes: list[Command] = []
        self._acks: list[Command] = []
        # what queue_into handed to a pipeline that has not answered yet (writes, acks)
        self._in_flight: tuple[list[Command], list[Command]] | None = None

    @property
    def atomic(self) -> bool:
        """Whether a step's writes go as one atomic script call."""
        return self._publish is not None

    def __len__(self) -> int:
        flying = sum(map(len, self._in_flight)) if self._in_flight else 0
        return len(self._writes) + len(self._acks) + flying

    def event(self, request_id: str, event: ReplyEvent, ttl_s: int | None = None) -> None:
        """Append a reply event at its fixed id (a copy already there is refused by Redis);
        ``ttl_s`` (re)sets the reply stream's expiry."""
        key = self.keys.reply_stream(request_id)
        self._writes.append(("xadd", (key, protocol.encode_event(event)), {"id": event.stream_id}))
        if ttl_s is not None:
            self._writes.append(("expire", (key, ttl_s), {}))

    def ack(self, stream: str, entry_id: str) -> None:
        self._acks.append(("xack", (stream, GROUP, entry_id), {}))

    def dead_letter(self, entry: Entry, refusal: Refusal, worker: str) -> None:
        """Record an entry that cannot be served, with the reason; the stream keeps about
        :data:`~tokenfleet.protocol.DEAD_LETTER_MAXLEN` entries of at most
        :data:`~tokenfleet.protocol.DEAD_LETTER_BODY_BYTES` of body each (Redis memory stays
        bounded however much bad input arrives; ``body_bytes`` says how large it was)."""
        body = protocol.pack(entry.fields)
        fields = {
            b"stream": entry.stream,
            b"entry": entry.entry_id,
            b"code": refusal.code,
            b"reason": refusal.message[:1000],
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
        if self._publish is not None:
            try:  # redis-py's Script loads the script if Redis lost it (a restart)
                reply = self._publish(*_script_form(self._writes + self._acks))
            except redis.ResponseError as e:
                if is_out_of_memory(e):
                    raise  # all of it stays queued: the loop backs off and sends it again
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
            full = next((r for r in results if isinstance(r, Exception) and is_out_of_memory(r)), None)
            if full is not None:  # keep it all, acknowledgements included, for the next try
                raise full
            queue.clear()
            errors += _refused(results)
        return errors

    def queue_into(self, pipe: Any) -> int:
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
        if self._publish is not None:
            script_keys, script_args = _script_form(writes + acks)
            pipe.evalsha(self._publish.sha, len(script_keys), *script_keys, *script_args)
            return 1
        for name, args, kwargs in writes + acks:
            getattr(pipe, name)(*args, **kwargs)
        return len(writes) + len(acks)

    def sent(self, results: list[Any]) -> list[Exception]:
        """After :meth:`queue_into`'s pipeline ran: drop what it carried, return what Redis
        refused. If Redis had lost the script (a restart) or refuses scripts, nothing ran: it goes
        again now, by :meth:`flush`."""
        if self.atomic and results:
            reply = results[0]
            if isinstance(reply, redis.ResponseError) and is_out_of_memory(reply):
                self.restore()  # what ran before the refusal is safe to send again
                raise reply
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
        self._publish = None


def is_out_of_memory(error: Exception) -> bool:
    """Redis refused a write because it reached ``maxmemory`` under ``noeviction``."""
    # redis-py turns an "OOM ..." reply into OutOfMemoryError, and keeps the text in a pipeline's
    return isinstance(error, redis.exceptions.OutOfMemoryError) or (
        isinstance(error, redis.ResponseError) and "used memory > 'maxmemory'" in str(error)
    )


def _script_form(commands: list[Command]) -> tuple[list[Any], list[Any]]:
    """KEYS and ARGV of :data:`scripts.PUBLISH` for the outbox's commands (XADD, EXPIRE, XACK)."""
    keys: list[Any] = []
    args: list[Any] = []
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


def _script_errors(reply: list[Any]) -> list[Exception]:
    """The commands :data:`scripts.PUBLISH` reported refused, as the errors a pipeline would return."""
    return [
        redis.ResponseError(message.decode() if isinstance(message, bytes) else str(message))
        for message in reply[1::2]
    ]


def _refused(results: list[Any]) -> list[Exception]:
    """Errors among pipeline replies: connection errors raise; refused duplicates of reply events
    are dropped (a retry after a lost connection re-sends events already stored)."""
    errors: list[Exception] = []
    for result in results:
        if isinstance(result, (redis.ConnectionError, redis.TimeoutError)):
            raise result
        if isinstance(result, Exception) and not protocol.is_duplicate_event_error(result):
            errors.append(result)
    return errors
