"""The worker: read requests from Redis, batch them, run them, stream tokens back, acknowledge.

The loop runs in-process (an accelerator worker never forks per job). Each turn it flushes what
the last step produced, reads at most what it could start soon, and runs one scheduler step.
A request is acknowledged only after its terminal event is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

import redis
from redis.cluster import RedisCluster

from tokenfleet import protocol
from tokenfleet.config import WorkerConfig
from tokenfleet.connection import connect_client
from tokenfleet.core.admission import Refusal
from tokenfleet.core.interface import BatchEvent, EngineCore, StepOutput
from tokenfleet.core.sequence import SeqState
from tokenfleet.core.vocab import render_chat
from tokenfleet.engines import build_core
from tokenfleet.errors import ProtocolError
from tokenfleet.producer.lookup import heartbeats
from tokenfleet.protocol import ErrorCode, Keys
from tokenfleet.worker.cancels import NOT_READ, CancelWatch
from tokenfleet.worker.exchange import Exchange, Received
from tokenfleet.worker.metrics import WorkerMetrics
from tokenfleet.worker.ratelog import RateLimitedLog
from tokenfleet.worker.recovery import Claimed, Reclaimer, read_progress
from tokenfleet.worker.streams import Entry, Outbox, StreamReader

log = logging.getLogger(__name__)

IDLE_BLOCK_MS = 500  # longest blocking read, so that a stop request is noticed promptly
FORMING_POLL_MS = 5  # while a batch waits for max_wait_ms: look for more requests this often
HEARTBEAT_S = 2.0
TRIM_EVERY_S = 5.0
FLEET_BUCKETS_TTL_S = 10.0
BACKOFF_START_S, BACKOFF_MAX_S = 0.1, 60.0
# overlap_io auto: run the round trip during the next step when it costs at least this share of
# a step; below that, hiding it is not worth making new work and cancels wait one more step
OVERLAP_MIN_SHARE = 0.05
EMA = 0.2  # weight of the newest sample in the step and round-trip averages
# While a batch runs and a step leaves nothing to send (no token events under a stream interval,
# no acknowledgements), the round trip that only reads new work and cancels goes at most this
# often rather than after every step: a tiny model's 2-3 ms steps each paid one for reads that
# mostly came back empty (a worker running them between steps served 1.17x the tokens/s without
# them, at a 50 ms stream interval; overlapped with the step they had cost about nothing), and
# Redis served hundreds of empty reads a second per worker. New work and cancels are then read
# up to this much later.
EXCHANGE_EVERY_S = 0.005


def connect(url: str, should_stop: Callable[[], bool] = lambda: False) -> redis.Redis:
    """A client for ``redis://`` or ``rediss://`` URLs (user/password in the URL work); a
    cluster-aware one when the server is a Redis Cluster node. While the server cannot be
    reached (a fleet whose Redis restarts), retried with capped backoff, as the loop does."""
    backoff = BACKOFF_START_S
    while True:
        try:
            return connect_client(url, socket_keepalive=True, health_check_interval=30)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            if should_stop():
                raise
            log.warning("redis unavailable at start-up (%s); retrying in %.1fs", e, backoff)
            time.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)


class Worker:
    def __init__(
        self,
        config: WorkerConfig,
        core: EngineCore | None = None,
        client: redis.Redis | None = None,
        on_batch: Callable[[BatchEvent], None] | None = None,
    ):
        self.config = config
        self.keys = Keys(config.prefix)
        self.core = core if core is not None else build_core(config)
        self.facts = self.core.facts
        self._stop = threading.Event()
        self.client = client or connect(config.redis_url, self._stop.is_set)
        self.name = config.name or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"
        streams = [self.keys.request_stream(b) for b in config.batching.buckets] + [self.keys.auto_stream]
        self.reader = StreamReader(self.client, streams, self.name)
        self.outbox = Outbox(self.client, self.keys)
        self.reclaimer = Reclaimer(self.client, streams, self.name, config.claim_idle_ms)
        self.cancels = CancelWatch(self.client, self.keys)
        # one round trip per step for replies, new work and cancels; a cluster pipeline does not
        # keep order across nodes, so there replies are flushed on their own, acks after events
        self._shared_round_trip = not isinstance(self.client, RedisCluster)
        self.exchange = Exchange(
            self.client, self.outbox, self.reader, self.cancels, overlap=config.overlap_io != "off"
        )
        self._decode_step_s = self._round_trip_s = 0.0  # moving averages, for overlap_io auto
        self._last_exchange = float("-inf")  # when the last round trip for work and cancels began
        self._overlap_pays = False  # overlap_io auto's last choice, logged when it changes
        self.metrics = WorkerMetrics(self.name)
        self._capacity = self.core.capacity()
        self._kv_peak = self._capacity  # the pool at its fullest since the last burst ended
        self.metrics.kv_blocks_total.set(self._capacity.kv_blocks_total)
        self._tokens_at_heartbeat = 0
        self.tokens_generated = 0
        self._warn = RateLimitedLog(log)  # repeated warnings: one line per 10 s per kind
        self._user_on_batch = on_batch
        self._last_heartbeat = 0.0
        self._last_trim = time.monotonic()
        self._recovered_own = False
        self._fleet_bucket_list: list[int] = []
        self._fleet_buckets_at = float("-inf")
        self.requests_finished = 0
        self.time_intake_s = self.time_step_s = self.time_redis_s = 0.0

    # -- lifecycle ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop taking new work; :meth:`run` returns once what is held has finished."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def setup(self) -> None:
        if self.config.metrics_port is not None and not self._metrics_served:
            self.metrics.serve(self.config.metrics_port)
            self._metrics_served = True
        self.reader.ensure_groups()
        self.client.sadd(self.keys.buckets, *self.config.batching.buckets)
        if self.config.max_queue is not None:
            limits = {str(b): self.config.max_queue for b in self.config.batching.buckets}
            self.client.hset(self.keys.max_queue, mapping={**limits, "auto": self.config.max_queue})
        self._heartbeat(force=True)
        self.cancels.start()
        if not self._recovered_own:  # once per process: our own unfinished entries first
            self._recovered_own = True
            own = self.reader.read_own_pending(self.config.batching.max_batch_size * 4)
            self._recover(self.reclaimer.with_deliveries(own))
        log.info(
            "worker %s serving buckets %s (mode %s, max_batch_size %d, max_wait_ms %g)",
            self.name,
            ",".join(map(str, self.config.batching.buckets)),
            self.config.batching.mode,
            self.config.batching.max_batch_size,
            self.config.batching.max_wait_ms,
        )

    def run(self) -> None:
        """Serve until :meth:`stop`; Redis connection errors are retried with capped backoff."""
        backoff = BACKOFF_START_S
        try:
            while True:
                try:
                    if not self.setup_done:
                        self.setup()
                        self.setup_done = True
                    if self.stopping and not self._holds_work():
                        break
                    self._turn()
                    backoff = BACKOFF_START_S
                except (redis.ConnectionError, redis.TimeoutError) as e:
                    log.warning("redis unavailable (%s); retrying in %.1fs", e, backoff)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, BACKOFF_MAX_S)
                except redis.ResponseError as e:
                    # e.g. a request stream or its group deleted under us (NOGROUP, or a blocked
                    # read unblocked because the key vanished): recreate the groups and go on
                    log.warning("redis refused a command (%s); re-creating groups in %.1fs", e, backoff)
                    self.setup_done = False
                    time.sleep(backoff)
                    backoff = min(backoff * 2, BACKOFF_MAX_S)
                except Exception:  # a bug must not stop the fleet's worker: log it, back off, go on
                    self.metrics.failed(ErrorCode.INTERNAL)
                    self._warn.log(logging.ERROR, "turn", "a turn of the loop failed", exc_info=True)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, BACKOFF_MAX_S)
        finally:
            self._teardown()

    setup_done = False
    _metrics_served = False

    def _holds_work(self) -> bool:
        return bool(self.core.held() or len(self.outbox))

    def _teardown(self) -> None:
        self.exchange.close()
        with contextlib.suppress(redis.RedisError):
            self.client.hdel(self.keys.workers, self.name)
        log.info(
            "worker %s stopped after %d requests (%.2fs reading/waiting for work, %.2fs in model steps, "
            "%.2fs in other Redis round trips)",
            self.name,
            self.requests_finished,
            self.time_intake_s,
            self.time_step_s,
            self.time_redis_s,
        )

    # -- one turn of the loop -------------------------------------------------------------------

    def _flush(self) -> None:
        for error in self.outbox.flush():
            log.error("redis refused a reply write: %s", error)

    def _turn(self) -> None:
        due = self._exchange_due()
        if due and self._overlapping():
            self._overlapped_turn()
            return
        t0 = time.perf_counter()
        cancels_read: object = NOT_READ
        if self.stopping:
            self._flush()
        elif due:
            cancels_read = self._intake()  # sends the last step's replies on the way
        else:  # no round trip this turn (EXCHANGE_EVERY_S): cancels wait for the next read
            cancels_read = None
        t1 = time.perf_counter()
        self._enforce_cancels_and_deadlines(cancels_read)
        t2 = time.perf_counter()
        outputs = self._step()
        t3 = time.perf_counter()
        self._publish(outputs)
        self._end_turn(outputs)
        # where the time goes: waiting for (and reading) work, the model, other Redis round trips
        self.time_intake_s += t1 - t0
        self.time_step_s += t3 - t2
        self.time_redis_s += (t2 - t1) + (time.perf_counter() - t3)

    def _overlapping(self) -> bool:
        """Whether this turn's round trip runs during its step: while a batch runs, on one
        server (a cluster pipeline keeps no order across nodes); with ``auto`` when the round
        trip, as last measured between steps, is a large enough share of a step."""
        mode = self.config.overlap_io
        if mode == "off" or not self._round_trip_rides_on_steps:
            return False
        if mode == "on":
            return True
        pays = self._round_trip_s >= OVERLAP_MIN_SHARE * self._decode_step_s > 0
        if pays != self._overlap_pays:
            self._overlap_pays = pays
            log.info(
                "Redis round trip %.2f ms against a %.2f ms decode step: %s",
                self._round_trip_s * 1000,
                self._decode_step_s * 1000,
                "overlapping it with the next step" if pays else "running it between steps",
            )
        return pays

    def _exchange_due(self) -> bool:
        """Whether this turn makes its round trip: always when idle, stopping, on a cluster (no
        shared round trip) or with replies to send; otherwise every EXCHANGE_EVERY_S."""
        if not self._round_trip_rides_on_steps:
            return True
        return bool(len(self.outbox)) or time.monotonic() - self._last_exchange >= EXCHANGE_EVERY_S

    def _overlapped_turn(self) -> None:
        """The last step's replies go out and new work and cancels come in while this step
        computes; replies of this step are queued after those, and what came in is acted on after
        the step: new work joins the next one, cancels stop their requests before it."""
        t0 = time.perf_counter()
        self._last_exchange = time.monotonic()
        self.exchange.start(self.config.batching.max_batch_size - self.core.num_waiting)
        try:
            outputs = self._step()
            t1 = time.perf_counter()
            self._publish(outputs)  # before any cancel is applied: a token never follows its done
        finally:
            received = self.exchange.finish()  # a connection error raises here, replies kept
        t2 = time.perf_counter()
        self._take(received)
        self._enforce_cancels_and_deadlines(received.cancels)
        self._end_turn(outputs)
        self.time_step_s += t1 - t0
        self.time_intake_s += t2 - t1  # the part of the round trip the step did not hide
        self.time_redis_s += time.perf_counter() - t2

    @property
    def _round_trip_rides_on_steps(self) -> bool:
        """Whether the Redis round trip goes with the steps of a running batch (one server, a
        batch in flight, not stopping) rather than once per turn on its own."""
        return self._shared_round_trip and self.core.has_work and not self.stopping

    def _step(self) -> StepOutput:
        began = time.perf_counter()
        try:
            output = self.core.step(flush=self.stopping)
        except Exception as e:  # a failed forward pass fails its sequences, never the worker
            started = self.core.running()
            self._warn.log(
                logging.ERROR,
                "step",
                "step failed; failing the %d sequences it held",
                len(started),
                exc_info=True,
            )
            for seq in self.core.abort({s.key for s in started}):
                self._finish_error(seq, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
            return StepOutput()
        for event in output.batches:
            self._on_batch(event)
        for seq, message in output.failed:  # rows the backend could not run; their batch-mates go on
            self._finish_error(seq, ErrorCode.INTERNAL, message)
        self.metrics.preemptions.inc(len(output.preempted))
        prefilled = any(event.kind == "prefill" for event in output.batches)
        if output.tokens and not prefilled:  # a prefill's length says nothing of the next steps
            self._decode_step_s = _average(self._decode_step_s, time.perf_counter() - began)
        return output

    def _end_turn(self, output: StepOutput) -> None:
        if not self._round_trip_rides_on_steps:
            self._flush()  # otherwise the next turn's round trip takes them along
        self._update_capacity()
        if output.tokens and not self.core.held():  # a burst of work is done
            self._log_memory()
            try:
                self.core.check_idle()
            except RuntimeError:  # a bug in the core's bookkeeping; the queue goes on
                log.exception("integrity check failed with the worker idle")
        self.reclaimer.touch(lambda: [seq.key for seq in self.core.held()])
        if time.monotonic() - self._last_trim > TRIM_EVERY_S:
            self._last_trim = time.monotonic()
            self.reader.trim_acknowledged()
        self._heartbeat()
        self._fleet_buckets()  # every FLEET_BUCKETS_TTL_S: {P}:buckets keeps live workers' only

    def _update_capacity(self) -> None:
        self._capacity = cap = self.core.capacity()
        if cap.kv_blocks_used > self._kv_peak.kv_blocks_used:
            self._kv_peak = cap
        m = self.metrics
        m.kv_blocks_used.set(cap.kv_blocks_used)
        m.running.set(cap.running)
        m.waiting.set(cap.waiting)

    def _log_memory(self) -> None:
        """Once a burst of work is done: how full the KV pool got, next to what a contiguous cache
        preallocated for max_batch_size x max_seq_len would have reserved."""
        peak, b = self._kv_peak, self.config.batching
        mib = 2**20
        contiguous = b.max_batch_size * b.max_seq_len * peak.kv_bytes_per_block // max(1, peak.block_size)
        log.info(
            "KV pool peak: %d/%d blocks used (%d free); %.1f MiB vs %.1f MiB for a contiguous %dx%d cache",
            peak.kv_blocks_used,
            peak.kv_blocks_total,
            peak.kv_blocks_free,
            peak.kv_blocks_used * peak.kv_bytes_per_block / mib,
            contiguous / mib,
            b.max_batch_size,
            b.max_seq_len,
        )
        self._kv_peak = self._capacity

    def _block_ms(self) -> int | None:
        """How long the read may wait: not at all while a batch runs; until the next batch is
        due while requests wait; a bounded idle wait otherwise."""
        if self.core.has_work:
            return None
        ready = self.core.ready_at()
        if ready is None:
            return IDLE_BLOCK_MS
        return min(IDLE_BLOCK_MS, max(1, int((ready - time.monotonic()) * 1000) + 1))

    def _intake(self) -> object:
        """Take new (and reclaimed) work; returns the turn's read of the cancels stream when it
        shared the round trip, else ``NOT_READ``."""
        room = self.config.batching.max_batch_size - self.core.num_waiting
        block = self._block_ms()
        if block is None and self._shared_round_trip:
            began = time.perf_counter()
            self._last_exchange = time.monotonic()
            self.exchange.start(room, background=False)
            received = self.exchange.finish()
            self._round_trip_s = _average(self._round_trip_s, time.perf_counter() - began)
            self._take(received)
            return received.cancels
        self._flush()  # never wait for work with replies unsent
        for entry in self._read(room, block):
            self._accept(entry)
        self._reclaim()
        return NOT_READ

    def _take(self, received: Received) -> None:
        """Accept what an exchange read (and reclaimed work); log the replies Redis refused."""
        for error in received.refused:
            log.error("redis refused a reply write: %s", error)
        for entry in received.entries:
            self._accept(entry)
        self._reclaim()

    def _read(self, room: int, block: int | None) -> list[Entry]:
        if room <= 0:
            return []
        if block is not None and self.core.num_waiting:
            # A batch is forming: wait for it here, not in a blocking read. Redis times blocked
            # reads out on its own clock tick (tens of ms late), which would add that much to
            # every max_wait_ms; slices keep a batch that fills early from waiting it out.
            ready = self.core.ready_at()
            left = IDLE_BLOCK_MS / 1000 if ready is None else ready - time.monotonic()
            if left > 0:
                time.sleep(min(left, FORMING_POLL_MS / 1000))
            block = None
        return self.reader.read(room, block)

    def _reclaim(self) -> None:
        room = self.config.batching.max_batch_size - self.core.num_waiting
        claimed_now = self.reclaimer.claim(room)
        if claimed_now:
            # our own entries too, when they sat idle past claim_idle_ms while we held them (e.g.
            # we could not reach Redis to touch them): those run here already
            held = {seq.key for seq in self.core.held()}
            claimed_now = [c for c in claimed_now if (c.entry.stream, c.entry.entry_id) not in held]
        self.metrics.reclaims.inc(len(claimed_now))
        self._recover(claimed_now)

    def _recover(self, entries: list[Claimed]) -> None:
        """Take entries delivered before (ours after a restart, or claimed from a dead worker).
        One delivered more than ``max_attempts`` times, a poison entry that killed every worker
        taking it say, is dead-lettered without being decoded again."""
        for claimed in entries:
            if claimed.deliveries > self.config.max_attempts:
                self._refuse(
                    claimed.entry,
                    ProtocolError(
                        ErrorCode.TOO_MANY_ATTEMPTS,
                        f"delivered {claimed.deliveries} times without finishing (max_attempts "
                        f"{self.config.max_attempts})",
                        dead_letter=True,
                    ),
                )
            else:
                self._accept(claimed.entry, redelivered=True)

    def _accept(self, entry: Entry, redelivered: bool = False) -> None:
        """Decode, validate and queue one entry; anything wrong is answered or dead-lettered. A
        redelivered entry resumes from the tokens its reply stream already holds."""
        try:
            self._admit_entry(entry, redelivered)
        except (redis.ConnectionError, redis.TimeoutError):
            raise  # not the entry's fault: retried by the loop, the entry stays pending
        except Exception as e:  # a bug must cost one request, never the worker
            log.exception("failed to take entry %s %s", entry.stream, entry.entry_id)
            self._refuse(
                entry, ProtocolError(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}", dead_letter=True)
            )

    def _admit_entry(self, entry: Entry, redelivered: bool) -> None:
        try:
            request = protocol.decode_request(entry.fields)
        except ProtocolError as e:
            self._refuse(entry, e)
            return
        try:
            if entry.stream == self.keys.auto_stream:
                self._route(entry, request)
                return
            seq = self._sequence(entry, request)
            self._claim_id(entry, request)
        except ProtocolError as e:
            self._refuse(entry, e)
            return
        if redelivered:
            progress = read_progress(self.client, self.keys, request.id)
            if progress.finished:  # an earlier attempt ended it; only its acknowledgement was lost
                self.outbox.ack(entry.stream, entry.entry_id)
                return
            seq.resume(progress.token_ids, progress.texts)
            if seq.finished:
                self._finish(seq)
                return
            log.info("resuming request %s after %d streamed tokens", request.id, len(progress.token_ids))
        if self._expired(seq, time.time()):
            self._finish_error(
                seq, ErrorCode.DEADLINE_EXCEEDED, "the deadline passed before the request started"
            )
            return
        now_wall, now = time.time(), time.monotonic()
        # the max_wait_ms window counts from when Redis accepted the request, not from our read
        arrived = now - min(max(0.0, now_wall - seq.enqueued_wall), 3600.0)
        try:
            self._check(self.core.add(seq, arrived), request)
        except ProtocolError as e:
            self._refuse(entry, e)

    def _check(self, refusal: Refusal | None, request: protocol.Request) -> None:
        """Raise a refusal of admission as the request's error reply."""
        if refusal is not None:
            raise ProtocolError(refusal.code, refusal.message, request_id=request.id)

    def _tokens(self, request: protocol.Request, largest_bucket: int | None = None) -> list[int]:
        admission = self.core.admission
        if request.input_ids is not None:
            ids = list(request.input_ids)
            self._check(admission.check_ids(ids), request)
            return ids
        self._check(admission.check_prompt_chars(request, largest_bucket), request)
        if request.messages is not None:
            return self._render_chat(request)
        return self.facts.tokenizer(request.prompt).input_ids

    def _render_chat(self, request: protocol.Request) -> list[int]:
        """Chat messages as the model's template renders them, with the generation prompt."""
        tokenizer = self.facts.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                "this worker's model has no chat template: send prompt or input_ids",
                request_id=request.id,
            )
        messages = [{"role": role, "content": content} for role, content in request.messages or ()]
        try:
            return render_chat(tokenizer, messages)
        except Exception as e:  # the template's own checks (roles in order, say): the request's fault
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"the chat template refused the messages: {e}",
                request_id=request.id,
            ) from e

    def _sequence(self, entry: Entry, request: protocol.Request) -> SeqState:
        self._check(self.core.admission.check_cap(request), request)
        return SeqState(
            key=(entry.stream, entry.entry_id),
            request=request,
            prompt_ids=self._tokens(request),
            tokenizer=self.facts.tokenizer,
            eos_ids=self.facts.eos_token_ids,
            enqueued_wall=_enqueued_wall(entry, request),
        )

    def _fleet_buckets(self, refresh: bool = False) -> list[int]:
        """Buckets served by live workers of the fleet (ours included), refreshed every few
        seconds from their heartbeats; ``{P}:buckets`` is brought in line on the way, so that
        buckets of workers that stopped long ago drop out of it and producers stop routing there."""
        now = time.monotonic()
        if refresh or now - self._fleet_buckets_at > FLEET_BUCKETS_TTL_S:
            live = {
                int(b)
                for beat in heartbeats(self.client, self.keys)
                if beat["alive"]
                for b in beat.get("buckets", [])
            }
            live |= set(self.config.batching.buckets)
            stale = {int(b) for b in self.client.smembers(self.keys.buckets)} - live
            pipe = self.client.pipeline(transaction=False)
            pipe.sadd(self.keys.buckets, *live)
            if stale:
                pipe.srem(self.keys.buckets, *stale)
            pipe.execute()
            self._fleet_bucket_list = sorted(live)
            self._fleet_buckets_at = now
        return self._fleet_bucket_list

    def _route(self, entry: Entry, request: protocol.Request) -> None:
        """Tokenize an ``auto`` entry and move it to the smallest bucket of the fleet that holds
        it (not only ours: workers may serve different buckets)."""
        buckets = self._fleet_buckets()
        ids = self._tokens(request, largest_bucket=buckets[-1])
        bucket = protocol.smallest_bucket(buckets, len(ids))
        if bucket is None:  # a worker with larger buckets may have joined since the last look
            buckets = self._fleet_buckets(refresh=True)
            bucket = protocol.smallest_bucket(buckets, len(ids))
        if bucket is None:
            raise ProtocolError(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt has {len(ids)} tokens; the largest bucket served is {buckets[-1]}",
                request_id=request.id,
            )
        first_seen = request.enqueued_ms or int(entry.enqueued_wall * 1000)
        routed = dataclasses.replace(
            request, prompt=None, messages=None, input_ids=tuple(ids), enqueued_ms=first_seen
        )
        self.outbox.move(entry, self.keys.request_stream(bucket), protocol.encode_request(routed))

    def _refuse(self, entry: Entry, error: ProtocolError) -> None:
        """Answer an entry that will not run: an ``error`` reply (with the request's own reply TTL
        where it can be read) when an id can be, a dead letter when the entry cannot be served at
        all; then acknowledge it. A duplicate id gets no reply: that stream is the first one's."""
        self.metrics.failed(error.code)
        salvaged_id, reply_ttl = protocol.salvage_reply(entry.fields)
        duplicate = error.code == ErrorCode.DUPLICATE_ID
        request_id = None if duplicate else error.request_id or salvaged_id
        if error.dead_letter:
            self._warn.log(
                logging.WARNING,
                "dead letter",
                "dead-lettering %s %s: %s",
                entry.stream,
                entry.entry_id,
                error.message[:300],
            )
            self.outbox.dead_letter(entry, error.code, error.message, self.name)
        else:
            log.debug("refusing request %s: %s", request_id, error.code)
        if request_id is not None:
            event = protocol.error_event(error.code, error.message)
            self.outbox.event(request_id, event, reply_ttl)
        self.outbox.ack(entry.stream, entry.entry_id)

    def _claim_id(self, entry: Entry, request: protocol.Request) -> None:
        """Make this entry the owner of its request id for as long as the replies live; a
        different entry that already owns it (in flight or answered) makes this one a
        ``duplicate_id``. The same entry redelivered after a crash owns it already."""
        key, me = self.keys.owner(request.id), f"{entry.stream} {entry.entry_id}"
        if self.client.set(key, me, nx=True, ex=request.reply_ttl_s):
            return
        owner = self.client.get(key)
        if owner is not None and owner.decode() != me:
            raise ProtocolError(
                ErrorCode.DUPLICATE_ID,
                f"request id {request.id} belongs to another request ({owner.decode()})",
                dead_letter=True,
            )

    # -- results --------------------------------------------------------------------------------

    def _publish(self, output: StepOutput) -> None:
        m = self.metrics
        outputs = output.tokens
        m.generation_tokens.inc(len(outputs))
        self.tokens_generated += len(outputs)
        interval = self.config.stream_interval_ms / 1000
        now = time.monotonic()
        for out in outputs:
            seq = out.seq
            first = out.index == seq.resumed_tokens  # this attempt's first token
            if first:
                m.requests_started.inc()
                m.prompt_tokens.inc(len(seq.prompt_ids))
                m.queue_time.observe(max(0.0, (seq.started or 0) - seq.enqueued_wall))
                m.ttft.observe(max(0.0, seq.first_token_at - seq.enqueued_wall))
            elif seq.prev_token_at is not None:
                m.itl.observe(seq.last_token_at - seq.prev_token_at)
            seq.unsent_ids.append(out.token_id)
            seq.unsent_text += out.text
            # the first token goes at once (TTFT); later ones wait for the stream interval
            if first or out.finished or now - seq.last_sent_at >= interval:
                self._send_tokens(seq, now)
            if out.finished:
                self._finish(seq)

    def _send_tokens(self, seq: SeqState, now: float | None = None) -> None:
        """Publish the tokens ``seq`` made since its last token event, as one event."""
        if not seq.unsent_ids:
            return
        req = seq.request
        index = len(seq.generated) - len(seq.unsent_ids)
        self.outbox.event(
            req.id,
            protocol.token_event(index, seq.unsent_ids, seq.unsent_text),
            req.reply_ttl_s if index == 0 else None,  # the event that creates the stream sets its TTL
        )
        seq.unsent_ids, seq.unsent_text = [], ""
        seq.last_sent_at = time.monotonic() if now is None else now

    def _finish(self, seq: SeqState) -> None:
        self._send_tokens(seq)  # tokens still held back by the stream interval go before the end
        req = seq.request
        done = protocol.done_event(
            seq.finish_reason,
            len(seq.prompt_ids),
            len(seq.generated),
            seq.timings(time.time()),
            seq.batch_size,
        )
        done["mean_batch_size"] = round(seq.mean_batch_size, 2)
        done["worker"] = self.name
        self.outbox.event(req.id, done, req.reply_ttl_s)
        self.outbox.ack(*seq.key)
        self.requests_finished += 1
        self.metrics.finished(seq.finish_reason)
        self.metrics.e2e.observe(done["timings"]["total_ms"] / 1000)

    def _finish_error(self, seq: SeqState, code: str, message: str) -> None:
        self.metrics.failed(code)
        self._send_tokens(seq)
        self.outbox.event(seq.request.id, protocol.error_event(code, message), seq.request.reply_ttl_s)
        self.outbox.ack(*seq.key)

    def _expired(self, seq: SeqState, now_wall: float) -> bool:
        deadline = seq.request.deadline_ms
        if deadline is not None and deadline <= now_wall * 1000:
            return True
        timeout = self.config.queue_timeout_s
        return timeout is not None and seq.started is None and now_wall - seq.enqueued_wall > timeout

    def _enforce_cancels_and_deadlines(self, cancels_read: object = NOT_READ) -> None:
        """Stop what was cancelled (done, finish reason ``cancelled``) or ran out of time
        (``deadline_exceeded``), running or not, before the next step: blocks are freed at once
        and a waiting request never starts."""
        held = self.core.held()
        if not held:
            return
        cancelled = self.cancels.cancelled(held, cancels_read)
        now = time.time()
        expired = {seq.key for seq in held if seq.key not in cancelled and self._expired(seq, now)}
        if not cancelled and not expired:
            return
        for seq in self.core.abort(cancelled | expired):
            if seq.key in cancelled:
                seq.finish_reason = protocol.FinishReason.CANCELLED
                self._finish(seq)
            else:
                where = "while running" if seq.started else "before the request started"
                self._finish_error(seq, ErrorCode.DEADLINE_EXCEEDED, f"the deadline passed {where}")

    def _on_batch(self, event: BatchEvent) -> None:
        if event.kind == "decode":
            self.metrics.decode_batch.observe(event.size)
        if event.kind == "prefill":
            self.metrics.prefill_batch.observe(event.size)
            self.metrics.padding_waste.observe(event.padding_waste)
            log.info(
                "batch size %d (prefill, %d tokens in %d forward(s), padding waste %.2f)",
                event.size,
                event.computed_tokens,
                event.forwards,
                event.padding_waste,
            )
        if self._user_on_batch is not None:
            self._user_on_batch(event)

    def _heartbeat(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last_heartbeat < HEARTBEAT_S:
            return
        generated = self.tokens_generated
        elapsed = now - self._last_heartbeat
        rate = (generated - self._tokens_at_heartbeat) / elapsed if elapsed < 60 else 0.0
        self._tokens_at_heartbeat = generated
        self._last_heartbeat = now
        cap = self._capacity
        self.client.hset(
            self.keys.workers,
            self.name,
            protocol.pack(
                {
                    "buckets": list(self.config.batching.buckets),
                    "engine": self.core.backend,
                    "device": self.facts.device,
                    "dtype": self.facts.dtype,
                    "mode": self.config.batching.mode,
                    "running": cap.running,
                    "waiting": cap.waiting,
                    "kv_blocks_used": cap.kv_blocks_used,
                    "kv_blocks_total": cap.kv_blocks_total,
                    "finished": self.requests_finished,
                    "tokens_per_s": round(rate, 1),
                    "seen": now,
                }
            ),
        )


def _enqueued_wall(entry: Entry, request: protocol.Request) -> float:
    """When Redis first accepted the request: its entry's time, or, for one a worker moved from
    the ``auto`` stream, the time the move carried (never later than the entry)."""
    if request.enqueued_ms is None:
        return entry.enqueued_wall
    return min(entry.enqueued_wall, request.enqueued_ms / 1000)


def _average(mean: float, sample: float) -> float:
    """An exponential moving average; the first sample starts it."""
    return sample if mean == 0.0 else (1 - EMA) * mean + EMA * sample
