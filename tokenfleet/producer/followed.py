"""What a reply reader keeps between reads, shared by the asyncio and the threaded reader: the
streams followed, how far each has been handed over, each one's inbox, and the client's private
wake-up stream (see :mod:`tokenfleet.producer.replies` for why it exists)."""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar

Entries = list[tuple[bytes, dict[bytes, bytes]]]


class Mailbox(Protocol):
    """An inbox: the asyncio reader's :class:`~tokenfleet.producer.replies.Inbox` or a
    :class:`queue.SimpleQueue`."""

    def put_nowait(self, item: Entries | BaseException, /) -> None: ...


InboxT = TypeVar("InboxT", bound=Mailbox)


class FollowedStreams(Generic[InboxT]):
    """Reply streams (named as Redis returns them: bytes) with their last id handed over and
    their follower's inbox. Not locked: the threaded reader holds its lock around every call."""

    def __init__(self, wake_key: str):
        self.positions: dict[bytes, str | bytes] = {}
        self.inboxes: dict[bytes, InboxT] = {}
        # each follow of a stream is a new one: a read sent for an earlier follow of it (from its
        # position, not this one's) hands this one nothing, and the next read asks from its own
        self._follows: dict[bytes, int] = {}
        self._asked: dict[bytes, int] = {}  # the follow each stream of the read in flight is for
        self._count = 0
        self.wake_name = wake_key.encode()
        self.wake_id: str | bytes = "0"
        self.wake_sent = False  # a wake-up is on its way to the read in flight

    def add(self, stream: str, after: str, inbox: InboxT) -> None:
        name = stream.encode()
        self.positions[name] = after
        self.inboxes[name] = inbox
        self._count += 1
        self._follows[name] = self._count

    def remove(self, stream: str) -> None:
        name = stream.encode()
        self.positions.pop(name, None)
        self.inboxes.pop(name, None)
        self._follows.pop(name, None)

    def __contains__(self, stream: str) -> bool:
        return stream.encode() in self.inboxes

    def __bool__(self) -> bool:
        return bool(self.positions)

    def to_read(self) -> dict[bytes, str | bytes]:
        """The next XREAD's streams and ids: every followed stream and the wake-up stream."""
        self._asked = dict(self._follows)
        return {**self.positions, self.wake_name: self.wake_id}

    def hand_over(self, reply: Any) -> None:
        """Put what an XREAD returned in each follower's inbox, in order."""
        self.wake_sent = False  # the read is back: streams followed from now on are in the next one
        for key, entries in reply or []:
            name = key if isinstance(key, bytes) else key.encode()
            if name == self.wake_name:
                self.wake_id = entries[-1][0]
                continue
            inbox = self.inboxes.get(name)
            # not unfollowed, nor followed anew from elsewhere, while the read was out
            if inbox is not None and entries and self._asked.get(name) == self._follows.get(name):
                self.positions[name] = entries[-1][0]
                inbox.put_nowait(entries)

    def fail_all(self, error: BaseException) -> None:
        """End every follower with ``error`` (raised where it waits for entries)."""
        for inbox in self.inboxes.values():
            inbox.put_nowait(error)
        self.clear()

    def clear(self) -> None:
        self.inboxes.clear()
        self.positions.clear()
        self._follows.clear()
