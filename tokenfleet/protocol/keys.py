"""Every Redis key tokenfleet uses, derived from one prefix, each with a line on what it holds."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tokenfleet.protocol.affinity import SHARDS
from tokenfleet.protocol.constants import AUTO_BUCKET, DEFAULT_LANE, LANES


@dataclass(frozen=True)
class Keys:
    """The keys of one fleet.

    Keys that workers touch together (the request streams, read in one XREADGROUP and one
    script; the backpressure hash the enqueue script reads beside a stream; the fleet registry)
    share the hash tag ``{prefix}``, so on Redis Cluster they live in one slot. Reply streams and
    cancel flags carry no tag, so they spread over every node.
    """

    prefix: str = "tokenfleet"

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in "{}*?[] "):
            raise ValueError(
                f"prefix must be non-empty without braces, glob characters or spaces: {self.prefix!r}"
            )

    @property
    def tag(self) -> str:
        """Hash tag of the keys that must share a cluster slot."""
        return "{" + self.prefix + "}"

    def request_stream(self, bucket: int | str, lane: str = DEFAULT_LANE) -> str:
        """Stream of ``lane``'s requests for prompts of at most ``bucket`` tokens (or ``auto``):
        ``{P}:req:<bucket>`` for the default lane, ``{P}:req:<bucket>:<lane>`` for the others."""
        return f"{self.tag}:req:{self.queue_name(bucket, lane)}"

    @staticmethod
    def queue_name(bucket: int | str, lane: str = DEFAULT_LANE) -> str:
        """A request stream's name after ``{P}:req:``: its field in the ``max_queue`` hash, and
        its row in ``tokenfleet status``."""
        return str(bucket) if lane == DEFAULT_LANE else f"{bucket}:{lane}"

    @property
    def auto_stream(self) -> str:
        """Ingress stream for untokenized prompts; a worker moves each entry to its bucket."""
        return self.request_stream(AUTO_BUCKET)

    def auto_stream_of(self, lane: str) -> str:
        """``lane``'s ingress stream for untokenized prompts."""
        return self.request_stream(AUTO_BUCKET, lane)

    def shard_stream(self, bucket: int, lane: str, shard: int) -> str:
        """Shard ``shard`` of a bucket's stream (``{P}:req:<bucket>[:<lane>]:s<shard>``): producers
        that follow the affinity rule (docs/PROTOCOL.md) put requests here."""
        return f"{self.request_stream(bucket, lane)}:s{shard}"

    def queue_streams(self, bucket: int | str, lane: str = DEFAULT_LANE) -> list[str]:
        """Every stream of one queue: the bucket's own stream (for producers that know nothing of
        shards), then its shards; ``auto`` has no shards."""
        base = self.request_stream(bucket, lane)
        if bucket == AUTO_BUCKET:
            return [base]
        return [base, *(f"{base}:s{k}" for k in range(SHARDS))]

    def lane_streams(self, buckets: Iterable[int]) -> list[list[str]]:
        """Every request stream a worker serving ``buckets`` may read, lane by lane, highest first:
        each bucket's stream and its shards, then the lane's ``auto`` stream."""
        buckets = list(buckets)
        return [
            [*(s for b in buckets for s in self.queue_streams(b, lane)), self.auto_stream_of(lane)]
            for lane in LANES
        ]

    def reply_stream(self, request_id: str) -> str:
        """Per-request stream of ``token`` events and one terminal ``done``/``error`` event."""
        return f"{self.prefix}:reply:{request_id}"

    def client_wake(self, client_id: str) -> str:
        """A client's own stream: an entry ends the client's blocked XREAD over the reply streams
        it follows, so that the next read includes a stream it started following (expires)."""
        return f"{self.prefix}:client:{client_id}:wake"

    def owner(self, request_id: str) -> str:
        """The request stream entry that owns a request id (``stream entry-id``), kept as long as
        its reply stream: a second entry with the same id is refused (``duplicate_id``)."""
        return f"{self.prefix}:owner:{request_id}"

    def cancel(self, request_id: str) -> str:
        """Exists (any value, with a TTL) when a request is cancelled; checked when a worker takes it."""
        return f"{self.prefix}:cancel:{request_id}"

    @property
    def cancels(self) -> str:
        """Stream of cancelled request ids (field ``id``), read by every worker each turn."""
        return f"{self.tag}:cancels"

    @property
    def dead_letter(self) -> str:
        """Stream of entries that could not be decoded or failed too many times, with the reason."""
        return f"{self.tag}:dead"

    def series(self, slot: int) -> str:
        """Hash of what the fleet did in one 10-second slot (tokens, requests, queue time, TTFT),
        summed by every worker and kept an hour: the dashboard's charts."""
        return f"{self.prefix}:series:{slot}"

    def bulk_cancel(self, job_id: str) -> str:
        """Exists (with a TTL) when bulk job ``job_id`` (``tokenfleet batch --enqueue``) is to stop."""
        return f"{self.prefix}:bulk-cancel:{job_id}"

    @property
    def audit(self) -> str:
        """Stream of the actions taken on the fleet from the dashboard (who, what, when)."""
        return f"{self.tag}:audit"

    @property
    def adapters(self) -> str:
        """Hash of adapter name -> JSON record (``path`` on the workers' disks, ``base`` model): the
        LoRA adapters this fleet serves, added at run time (``tokenfleet lora add``)."""
        return f"{self.tag}:adapters"

    @property
    def max_queue(self) -> str:
        """Hash of bucket -> most entries that may wait undelivered on its stream (backpressure)."""
        return f"{self.tag}:max_queue"

    @property
    def buckets(self) -> str:
        """Set of bucket sizes that live workers serve; producers route by it."""
        return f"{self.tag}:buckets"

    @property
    def workers(self) -> str:
        """Hash of worker name -> msgpack heartbeat (buckets, device, last seen)."""
        return f"{self.tag}:workers"

    def completion(self, completion_id: str) -> str:
        """The gateway's record of an OpenAI completion (its kind, model and requests), kept as
        long as the replies: any replica can resume or replay it."""
        return f"{self.prefix}:completion:{completion_id}"

    def response(self, response_id: str) -> str:
        """A Responses API response: a hash of its body and history (``record``), a ``cancelled``
        flag and, once it has ended, the response object (``final``)."""
        return f"{self.prefix}:response:{response_id}"

    def webhook(self, event_id: str) -> str:
        """A webhook event: its ``body``, the endpoints that took it (``ok:<digest>``), its attempts."""
        return f"{self.tag}:webhook:{event_id}"

    @property
    def webhooks_due(self) -> str:
        """Sorted set of webhook events not yet delivered everywhere, by when they are next due."""
        return f"{self.tag}:webhooks:due"

    @property
    def open_responses(self) -> str:
        """Sorted set of background responses a gateway follows to their end (for their webhook),
        by when the replica following each must renew its lease."""
        return f"{self.tag}:responses:open"

    def idempotency(self, key_digest: str) -> str:
        """The completion an ``Idempotency-Key`` (by its SHA-256) stands for, for a while."""
        return f"{self.prefix}:idempotency:{key_digest}"

    def file(self, file_id: str) -> str:
        """A Batch API file: a hash of its metadata and ``content``."""
        return f"{self.prefix}:file:{file_id}"

    def batch(self, batch_id: str) -> str:
        """A Batch API batch: a hash of its state, as ``GET /v1/batches/<id>`` returns it."""
        return f"{self.prefix}:batch:{batch_id}"

    @property
    def patterns(self) -> tuple[str, str]:
        """SCAN/ACL glob patterns that cover every key of this prefix."""
        return f"{self.tag}:*", f"{self.prefix}:*"
