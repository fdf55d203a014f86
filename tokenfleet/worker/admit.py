"""Taking one entry in: tokenize (or render the chat), route an ``auto`` entry to its bucket, take
ownership of the request id, resume a redelivered request, and queue it in the core; anything
wrong is answered with its refusal. An entry costs only itself: nothing here raises but a lost
connection to Redis."""

from __future__ import annotations

import dataclasses
import logging
import time

import redis

from tokenfleet import protocol
from tokenfleet.core.interface import EngineCore
from tokenfleet.core.sequence import SeqState
from tokenfleet.core.vocab import render_chat
from tokenfleet.protocol import LANES, ErrorCode, FinishReason, Keys, Refusal, Request
from tokenfleet.protocol.affinity import shard_of
from tokenfleet.transport.adapters import AdapterRegistry
from tokenfleet.transport.intake import Entry, Incoming
from tokenfleet.transport.outbox import Outbox
from tokenfleet.transport.ownership import take_ownership
from tokenfleet.transport.reclaim import read_progress
from tokenfleet.worker.publisher import Publisher
from tokenfleet.worker.stops import expired
from tokenfleet.worker.upkeep import FleetBuckets

log = logging.getLogger(__name__)

MAX_QUEUE_CLOCK_SKEW_S = 3600.0  # an entry's age beyond this is a clock problem, not a wait


class Admitter:
    """Turns :class:`Incoming` entries into sequences of the core, or into their refusals."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        core: EngineCore,
        outbox: Outbox,
        publisher: Publisher,
        fleet: FleetBuckets,
        queue_timeout_s: float | None,
        adapters: AdapterRegistry,
        served_model: str,
    ):
        self.client = client
        self.keys = keys
        self.core = core
        self.outbox = outbox
        self.publisher = publisher
        self.fleet = fleet
        self.queue_timeout_s = queue_timeout_s
        self.adapters, self.served_model = adapters, served_model
        self.auto_streams = {keys.auto_stream_of(lane) for lane in LANES}

    def take(self, incoming: Incoming) -> None:
        """Admit, route, answer or refuse one entry."""
        entry = incoming.entry
        try:
            refusal = incoming.refusal or self._admit(incoming)
        except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.OutOfMemoryError):
            raise  # not the entry's fault (Redis away, or full): the entry stays pending, is reclaimed
        except Exception as e:  # a bug must cost one request, never the worker
            log.exception("failed to take entry %s %s", entry.stream, entry.entry_id)
            refusal = Refusal(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}", dead_letter=True)
        if refusal is not None:
            self.publisher.refuse(entry, refusal, incoming.request)

    def _admit(self, incoming: Incoming) -> Refusal | None:
        entry, request = incoming.entry, incoming.request
        assert request is not None  # an entry without a request carries its refusal
        if self.core.facts.task == "embed" and request.embed is None:  # never routed by its tokens
            return Refusal(
                ErrorCode.INVALID_REQUEST,
                "this worker serves an embedding model: it embeds (embed) and does not generate text",
            )
        if entry.stream in self.auto_streams:
            return self._route(entry, request)
        seq = self._sequence(entry, request)
        if isinstance(seq, Refusal):
            return seq
        owner = take_ownership(self.client, self.keys, entry, request.id, request.reply_ttl_s)
        if owner.duplicate_of is not None:
            message = f"request id {request.id} belongs to another request ({owner.duplicate_of})"
            return Refusal(ErrorCode.DUPLICATE_ID, message, dead_letter=True)
        if incoming.redelivered and not self._resume(seq):
            return None
        if owner.cancelled:
            seq.finish_reason = FinishReason.CANCELLED
            self.publisher.finish(seq)
        elif expired(seq, time.time(), self.queue_timeout_s):
            self.publisher.fail(
                seq, ErrorCode.DEADLINE_EXCEEDED, "the deadline passed before the request started"
            )
        else:
            return self.core.add(seq, _arrived(seq))
        return None

    def _resume(self, seq: SeqState) -> bool:
        """Pick up after an earlier attempt from the tokens on the reply stream; False when there
        is nothing left to run (it ended before, or its tokens already finish it)."""
        progress = read_progress(self.client, self.keys, seq.request.id)
        if progress.finished:  # an earlier attempt ended it; only its acknowledgement was lost
            self.outbox.ack(*seq.key)
            return False
        seq.resume(progress.token_ids, progress.texts)
        if seq.finished:
            self.publisher.finish(seq)
            return False
        log.info("resuming request %s after %d streamed tokens", seq.request.id, len(progress.token_ids))
        return True

    def _sequence(self, entry: Entry, request: Request) -> SeqState | Refusal:
        refusal = None if request.embed is not None else self.core.admission.check_cap(request)
        ids = refusal or self._tokens(request)
        if isinstance(ids, Refusal):
            return ids
        matcher = self.core.output_constraint(request)  # a cached compile, or a bounded one
        if isinstance(matcher, Refusal):
            return matcher
        facts = self.core.facts
        return SeqState(
            key=entry.key,
            request=request,
            prompt_ids=ids,
            tokenizer=facts.tokenizer,
            eos_ids=facts.eos_token_ids,
            enqueued_wall=_enqueued_wall(entry, request),
            matcher=matcher,
            adapter_path=self._adapter_path(request.adapter),
        )

    def _adapter_path(self, name: str | None) -> str | None:
        """Where the fleet says adapter ``name`` lies, if it knows it for this worker's model
        (the core refuses the request otherwise)."""
        record = None if name is None else self.adapters.get(name)
        if record is None or record.base not in (None, self.served_model):
            return None
        return record.path

    def _tokens(self, request: Request, largest_bucket: int | None = None) -> list[int] | Refusal:
        admission = self.core.admission
        if request.embed is not None:  # the model's own tokenization and truncation
            return self.core.embed_ids(request)
        if request.input_ids is not None:
            ids = list(request.input_ids)
            return admission.check_ids(ids) or ids
        refusal = admission.check_prompt_chars(request, largest_bucket)
        if refusal is not None:
            return refusal
        if request.messages is not None:
            return self._render_chat(request)
        return list(self.core.facts.tokenizer(request.prompt).input_ids)

    def _render_chat(self, request: Request) -> list[int] | Refusal:
        """Chat messages as the model's template renders them, with the generation prompt."""
        tokenizer = self.core.facts.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            return Refusal(
                ErrorCode.INVALID_REQUEST,
                "this worker's model has no chat template: send prompt or input_ids",
            )
        messages = [{"role": role, "content": content} for role, content in request.messages or ()]
        try:
            return render_chat(tokenizer, messages)
        except Exception as e:  # the template's own checks (roles in order, say): the request's fault
            return Refusal(ErrorCode.INVALID_REQUEST, f"the chat template refused the messages: {e}")

    def _route(self, entry: Entry, request: Request) -> Refusal | None:
        """Tokenize an ``auto`` entry and move it to the smallest bucket of the fleet that holds
        it (not only ours: workers may serve different buckets)."""
        buckets = self.fleet.get()
        ids = self._tokens(request, largest_bucket=buckets[-1])
        if isinstance(ids, Refusal):
            return ids
        bucket = protocol.smallest_bucket(buckets, len(ids))
        if bucket is None:  # a worker with larger buckets may have joined since the last look
            buckets = self.fleet.get(refresh=True)
            bucket = protocol.smallest_bucket(buckets, len(ids))
        if bucket is None:
            message = f"prompt has {len(ids)} tokens; the largest bucket served is {buckets[-1]}"
            return Refusal(ErrorCode.PROMPT_TOO_LONG, message)
        first_seen = request.enqueued_ms or int(entry.enqueued_wall * 1000)
        if request.embed is not None:  # its text goes on: the worker tokenizes it as the model does
            routed = dataclasses.replace(request, enqueued_ms=first_seen)
        else:
            routed = dataclasses.replace(
                request, prompt=None, messages=None, input_ids=tuple(ids), enqueued_ms=first_seen
            )
        # the shard follows the request as sent (its messages or text), as a producer's would
        target = self.keys.shard_stream(bucket, request.priority, shard_of(request.to_wire()))
        self.outbox.move(entry, target, protocol.encode_request(routed))
        return None


def _enqueued_wall(entry: Entry, request: Request) -> float:
    """When Redis first accepted the request: its entry's time, or, for one a worker moved from
    the ``auto`` stream, the time the move carried (never later than the entry)."""
    if request.enqueued_ms is None:
        return entry.enqueued_wall
    return min(entry.enqueued_wall, request.enqueued_ms / 1000)


def _arrived(seq: SeqState) -> float:
    """When the request entered the queue, on the monotonic clock: max_wait_ms counts from when
    Redis accepted it, not from our read."""
    now_wall, now = time.time(), time.monotonic()
    return now - min(max(0.0, now_wall - seq.enqueued_wall), MAX_QUEUE_CLOCK_SKEW_S)
