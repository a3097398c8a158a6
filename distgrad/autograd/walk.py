"""The walk: which leaves, recv functions and nodes a region of the local graph
holds, seen from its entries (the roots, a send function), never past a recv
function or a leaf. It runs on every backward, so it is kept to the bone: a
Python object per node is what torch makes when ``next_functions`` is read, and
the walk reads each node's once.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils.checkpoint as _ckpt

from .rpc_functions import _node_types

_ACCUMULATE = None


def accumulate_type() -> type:
    global _ACCUMULATE
    if _ACCUMULATE is None:
        a = torch.zeros(1, requires_grad=True)
        with torch.enable_grad():   # a backward may start under no_grad()
            _ACCUMULATE = type((a * 1).grad_fn.next_functions[0][0])
    return _ACCUMULATE


def below(starts: Sequence[Any]) -> set:
    """The nodes reachable from ``starts``, without going past recv functions and
    leaves (they are included)."""
    nodes: set = set()
    _spread(nodes, list(starts), None)
    return nodes


def _spread(seen: set, stack: list, recvs: list | None) -> None:
    """Add to ``seen`` what ``stack`` reaches, never past a recv function (noted in
    ``recvs``) or a leaf (its node has no next edges)."""
    _, recv_t = _node_types()
    seen.update(stack)
    while stack:
        n = stack.pop()
        if type(n) is recv_t:
            if recvs is not None:
                recvs.append(n)
            continue
        for nxt, _ in n.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)


def checkpoint_type() -> type:
    """The node type of a reentrant checkpoint (``CheckpointFunction``'s)."""
    return _ckpt.CheckpointFunction._backward_cls


class Region:
    __slots__ = ("leaves", "recvs", "checkpoints")

    def __init__(self) -> None:
        self.leaves: list[torch.Tensor] = []
        self.recvs: list = []  # recv functions met (the walk stops there)
        self.checkpoints: list = []  # reentrant checkpoints' nodes (see .checkpoint)


def walk_region(starts: Sequence[Any], region: Region, recv_slots: dict[int, set]) -> set:
    """Collect into ``region`` its leaves (AccumulateGrad nodes) and recv functions,
    and into ``recv_slots`` (recv message id -> input slots) the slots of recv
    functions some walked node feeds; returns the nodes walked."""
    _, recv_t = _node_types()
    acc_t = accumulate_type()
    ckpt_t = checkpoint_type()
    leaves = region.leaves
    seen = set(starts)
    stack = list(seen)
    while stack:
        n = stack.pop()
        t = type(n)
        if t is acc_t:
            leaves.append(n)  # its .variable costs a tensor wrapper: only on demand
            continue
        if t is recv_t:
            region.recvs.append(n)
            continue
        if t is ckpt_t:
            region.checkpoints.append(n)
        for nxt, slot in n.next_functions:
            if nxt is not None:
                if type(nxt) is recv_t:
                    recv_slot(recv_slots, nxt, slot)
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
    return seen


def recv_slot(recv_slots: dict[int, set], recv: Any, slot: int) -> None:
    slots = recv_slots.get(recv.dg_info[1])
    if slots is None:
        slots = recv_slots[recv.dg_info[1]] = set()
    slots.add(slot)


def walk_reach(reach: set, starts: Sequence[Any]) -> list:
    """Discovery: add to ``reach`` what ``starts`` reach; returns the recv functions met."""
    recvs: list = []
    _spread(reach, [n for n in starts if n not in reach], recvs)
    return recvs


def fed_slots_below(starts: list) -> dict[int, set]:
    """Recv message id -> the slots fed by nodes reachable from edges ``starts``."""
    _, recv_t = _node_types()
    fed: dict[int, set] = {}
    edges = [(e.node, e.output_nr) for e in starts]
    for n in below([e.node for e in starts]):
        if type(n) is not recv_t:
            edges.extend(n.next_functions)
    for nxt, slot in edges:
        if type(nxt) is recv_t:
            fed.setdefault(nxt.dg_info[1], set()).add(slot)
    return fed
