"""Moves frames between workers; knows nothing of pickles."""
from .base import Transport, TransportHandler
from .zmq_transport import ZmqTransport

__all__ = ["Transport", "TransportHandler", "ZmqTransport"]
