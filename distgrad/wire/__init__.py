"""Turns Python objects into frames and back (no sockets here)."""
from .pickler import TensorSpec, dumps, loads
from .messages import Kind, Message, decode, encode

__all__ = ["TensorSpec", "dumps", "loads", "Kind", "Message", "encode", "decode"]
