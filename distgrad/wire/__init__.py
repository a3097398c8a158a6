"""Turns Python objects into frames and back (no sockets here)."""
from .fast_header import encode_fast
from .messages import Kind, Message, decode, encode
from .pickler import TensorSpec, dumps, loads

__all__ = ["TensorSpec", "dumps", "loads", "Kind", "Message", "encode", "decode", "encode_fast"]
