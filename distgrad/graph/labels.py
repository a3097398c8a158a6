"""Texts and colours of a distributed autograd graph picture, shared by the
Graphviz path (``export.to_dot``) and the matplotlib one (``draw``).

Example::

    node_label({"name": "SendRpcBackward", "kind": "send", "message_id": 1, "bytes": 4096}, {})
    # 'SendRpcBackward\\nmsg 0.1, 4.0 KiB'
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

COLORS = {"send": "#f4a582", "recv": "#92c5de", "leaf": "#d9f0a3", "op": "#f0f0f0"}
CROSS_COLOR = "#b2182b"


def human(n: float) -> str:
    """Bytes for people: ``human(2560) == '2.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def shape(dims: Sequence[int]) -> str:
    """``shape([64, 128]) == '64x128'``; an empty shape is ``'scalar'``."""
    return "x".join(map(str, dims)) if len(dims) else "scalar"


def msg(mid: int | None) -> str:
    """An autograd message id as <creating worker>.<counter>: ``msg((1 << 48) + 2) == '1.2'``."""
    return "?" if mid is None else f"{mid >> 48}.{mid & ((1 << 48) - 1)}"


def title(desc: dict) -> str:
    """The picture's two-line title."""
    return (f"distributed autograd graph of context {desc['context_id']}\n"
            "(arrows: forward data flow; gradients flow back along them)")


def node_label(n: dict, names: dict[int, str]) -> str:
    """A node's text: its autograd name, then shape (leaf), size (send) or sender (recv)."""
    label = n["name"].replace("torch::autograd::", "")
    if n["kind"] == "leaf":
        if n.get("shape") is not None:
            label += "\n" + (shape(n["shape"]) + " " + n.get("dtype", "")).strip()
    elif n["kind"] == "send":
        label += f"\nmsg {msg(n.get('message_id'))}, {human(n['bytes'])}"
    elif n["kind"] == "recv":
        sender = n.get("sender")
        label += f"\nmsg {msg(n.get('message_id'))} from {names.get(sender, f'rank {sender}')}"
    if n.get("device"):   # on an accelerator: where, and on which stream
        label += f"\non {n['device']}" + (f", stream {n['stream']}" if n.get("stream") is not None else "")
    return label


def edge_label(e: dict, tensors: Sequence[dict[str, Any]]) -> str:
    """A cross-worker edge's text: bytes, then each tensor's shape and dtype."""
    what = ", ".join(f"{shape(t['shape'])} {t['dtype']}" for t in tensors)
    return human(e["bytes"]) + (f"\n{what}" if what else "")
