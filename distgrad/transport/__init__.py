"""Moves frames between workers; knows nothing of pickles."""
from .base import Transport, TransportHandler
from .socket_transport import SocketTransport

__all__ = ["SocketTransport", "Transport", "TransportHandler"]
