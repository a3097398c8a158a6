"""The transport interface every backend implements.

A transport sends on the calling thread and reads with its own pool of
threads. Received messages and lost peers are reported to a
:class:`TransportHandler` in order (one event at a time); ``on_message`` may
return work (``(fn, args)``) that the thread which read the message then runs.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol


class TransportHandler(Protocol):
    def on_message(self, peer: int, frames: list) -> tuple | None:
        """Called with the frames of one message from ``peer``, in arrival order;
        returns the work to run for it, if any."""

    def on_peer_lost(self, peer: int, reason: str, graceful: bool) -> None:
        """Called once when ``peer`` is gone (``graceful``: said goodbye)."""

    def on_send_failed(self, peer: int, messages: list, error: BaseException) -> None:
        """(Optional) ``messages`` (frame lists, as given to ``send``) queued for
        ``peer`` were dropped unsent: ``error`` was raised while sealing the batch
        they were in (whichever thread sent them). The connection stays."""

    def on_peer_joined(self, peer: int) -> None:
        """(Optional; dynamic groups) ``peer`` connected after start-up and was
        admitted; called before anything it sends is handed up."""


class Timer:
    """Handle of a :meth:`Transport.call_later` callback."""

    __slots__ = ("when", "fn", "cancelled")

    def __init__(self, when: float, fn: Callable[[], None]) -> None:
        self.when, self.fn, self.cancelled = when, fn, False

    def cancel(self) -> None:
        self.cancelled = True

    def __lt__(self, other: Timer) -> bool:
        return self.when < other.when


class Transport(ABC):
    """Frames in, frames out, events handed up in order, peer loss reported once."""

    @abstractmethod
    def listen(self, host: str) -> str:
        """Bind a listening endpoint on ``host``; returns the address peers connect to."""

    @abstractmethod
    def start(self, handler: TransportHandler, peers: Mapping[int, str], admit=None, listed=None) -> None:
        """Connect to ``peers`` (rank -> address) and start reading. A dynamic group's
        member passes ``admit(rank)`` (the address of a member that connects later, or
        None to refuse it) and ``listed(rank)`` (whether a peer it cannot reach is
        still a member); see :meth:`~.socket_transport.SocketTransport.start`."""

    @abstractmethod
    def send(self, peer: int, frames: Sequence) -> None:
        """Send one message to ``peer`` from this thread; thread safe. A reading
        thread never blocks here (what does not fit is flushed later)."""

    def send_soon(self, peer: int, frames: Sequence) -> None:
        """Send a one-way message nobody waits for with the next message to ``peer``,
        or a little later (here: at once)."""
        self.send(peer, frames)

    @abstractmethod
    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in order with the handler's events; thread safe."""

    @abstractmethod
    def call_later(self, delay: float, fn: Callable[[], None], wake: bool = True) -> Timer:
        """Run ``fn`` in order with the handler's events after ``delay`` seconds; thread safe.

        ``wake=False``: the caller needs no early wake-up for it."""

    def on_io_thread(self) -> bool:
        """Whether this thread is reading for the transport (it must not block)."""
        return False

    @abstractmethod
    def close(self, linger: float = 1.0) -> None:
        """Say goodbye to every peer, flush for at most ``linger`` s, stop the thread."""
