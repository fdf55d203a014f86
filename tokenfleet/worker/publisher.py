"""Turning what the engine did into reply events: tokens (coalesced per stream interval), the one
terminal event per request, and the acknowledgement after it. Queued on the outbox; the turn
decides when the outbox goes out."""

from __future__ import annotations

import logging
import time

from tokenfleet.core.interface import StepOutput
from tokenfleet.core.sequence import SeqState
from tokenfleet.protocol import DoneEvent, ErrorCode, ErrorEvent, Refusal, Request, TokenEvent, salvage_reply
from tokenfleet.ratelog import RateLimitedLog
from tokenfleet.tracing import Tracer
from tokenfleet.transport.intake import Entry
from tokenfleet.transport.outbox import Outbox
from tokenfleet.worker.metrics import WorkerMetrics
from tokenfleet.worker.spans import RequestSpans

log = logging.getLogger(__name__)


class Publisher:
    """Reply events for one worker's requests."""

    def __init__(
        self,
        outbox: Outbox,
        metrics: WorkerMetrics,
        worker: str,
        stream_interval_ms: float,
        tracer: Tracer | None = None,
    ):
        self.outbox = outbox
        self.metrics = metrics
        self.worker = worker
        self.spans = RequestSpans(tracer, worker)
        self.interval_s = stream_interval_ms / 1000
        self.requests_finished = 0
        self.tokens_generated = 0
        self._warn = RateLimitedLog(log)

    def publish(self, output: StepOutput) -> None:
        """A step's tokens: the first of a request at once (TTFT), later ones when the stream
        interval has passed, the last with the terminal event."""
        m = self.metrics
        m.generated(len(output.tokens))
        self.tokens_generated += len(output.tokens)
        now = time.monotonic()
        for out in output.tokens:
            seq = out.seq
            first = out.index == seq.resumed_tokens  # this attempt's first token
            if first:
                queued = max(0.0, (seq.started or 0) - seq.enqueued_wall)
                ttft = max(0.0, (seq.first_token_at or 0) - seq.enqueued_wall)
                m.started(seq.request.priority, len(seq.prompt_ids), queued, ttft)
                self.spans.started(seq)
            elif seq.prev_token_at is not None and seq.last_token_at is not None:
                m.token_gap(seq.last_token_at - seq.prev_token_at)
            seq.unsent_ids.append(out.token_id)
            seq.unsent_text += out.text
            if out.logprob is not None:
                seq.unsent_logprobs.append(out.logprob)
            if first or out.finished or now - seq.last_sent_at >= self.interval_s:
                self._send_tokens(seq, now)
            if out.finished:
                self.finish(seq)
        for seq, vector in output.embedded:  # one pass made the whole answer: started and ended
            queued = max(0.0, (seq.started or 0) - seq.enqueued_wall)
            m.started(seq.request.priority, len(seq.prompt_ids), queued, queued)
            self.finish(seq, vector)
        for seq, message in output.failed:  # rows the engine could not run; their batch-mates go on
            self.fail(seq, ErrorCode.INTERNAL, message)
        for seq, refusal in output.refused:  # rows the core would not start (their adapter cannot load)
            self.fail(seq, refusal.code, refusal.message)

    def finish(self, seq: SeqState, embedding: bytes | None = None) -> None:
        """End ``seq`` with ``done`` (its finish reason; an embedding request's vector), then
        acknowledge its entry."""
        self._send_tokens(seq)  # tokens still held back by the stream interval go first
        req = seq.request
        done = DoneEvent(
            finish_reason=seq.finish_reason or "stop",
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.generated),
            timings=seq.timings(time.time()),
            batch_size=seq.batch_size,
            mean_batch_size=round(seq.mean_batch_size, 2),
            worker=self.worker,
            embedding=embedding,
            cached_tokens=min(seq.cached_tokens, len(seq.prompt_ids)),  # a resumed one's counts its output
            stop=seq.stop_string if seq.finish_reason == "stop" else None,
        )
        self.outbox.event(req.id, done, req.reply_ttl_s)
        self.outbox.ack(*seq.key)
        self.spans.ended(seq)
        self.requests_finished += 1
        self.metrics.finished(done.finish_reason, req.priority, done.timings["total_ms"] / 1000)

    def fail(self, seq: SeqState, code: str, message: str) -> None:
        """End ``seq`` with an ``error`` after the tokens it made, then acknowledge its entry."""
        self.metrics.failed(code)
        self._send_tokens(seq)
        self.outbox.event(seq.request.id, ErrorEvent(code, message), seq.request.reply_ttl_s)
        self.outbox.ack(*seq.key)
        self.spans.ended(seq, f"{code}: {message}")

    def refuse(self, entry: Entry, refusal: Refusal, request: Request | None = None) -> None:
        """Answer an entry that will not run: an ``error`` reply when an id can be read (with
        the request's own reply TTL where it can be read), a dead letter when asked; then
        acknowledge it. A duplicate id gets no reply: that stream is the first request's."""
        self.metrics.failed(refusal.code)
        if request is not None:
            request_id: str | None = request.id
            reply_ttl = request.reply_ttl_s
        else:
            request_id, reply_ttl = salvage_reply(entry.fields)
        if refusal.dead_letter:
            self._warn.log(
                logging.WARNING,
                "dead letter",
                "dead-lettering %s %s: %s",
                entry.stream,
                entry.entry_id,
                refusal.message[:300],
            )
            self.outbox.dead_letter(entry, refusal, self.worker)
        else:
            log.debug("refusing request %s: %s", request_id, refusal.code)
        if request_id is not None and refusal.code != ErrorCode.DUPLICATE_ID:
            self.outbox.event(request_id, ErrorEvent(refusal.code, refusal.message), reply_ttl)
        self.outbox.ack(entry.stream, entry.entry_id)

    def _send_tokens(self, seq: SeqState, now: float | None = None) -> None:
        """Publish the tokens ``seq`` made since its last token event, as one event."""
        if not seq.unsent_ids:
            return
        req = seq.request
        index = len(seq.generated) - len(seq.unsent_ids)
        # the event that creates the stream sets its TTL
        logprobs = seq.unsent_logprobs if req.logprobs is not None else None
        self.outbox.event(
            req.id,
            TokenEvent(index, seq.unsent_ids, seq.unsent_text, logprobs),
            req.reply_ttl_s if index == 0 else None,
        )
        seq.unsent_ids, seq.unsent_text, seq.unsent_logprobs = [], "", []
        seq.last_sent_at = time.monotonic() if now is None else now
