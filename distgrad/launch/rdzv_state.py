"""torch's elastic rendezvous state as JSON data, both ways (for the ``distgrad``
rendezvous backend, :mod:`.elastic_rdzv`): the state lives in a store as checked
JSON, never as a pickle, and torch's state holder gets its own state object back.

Example::

    >>> from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState
    >>> state_from_json(state_to_json(_RendezvousState())).round
    0
"""
from __future__ import annotations

import io
import pickle
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

_MAX_NODES = 100_000     # entries per list in a state (a bound on what is parsed)
_MAX_ADDR = 1024


def _node(n: _NodeDesc) -> list:
    if len(n.addr) > _MAX_ADDR:
        raise ValueError(f"a node's address has {len(n.addr)} characters, at most {_MAX_ADDR} "
                         "fit the distgrad rendezvous (--local-addr)")
    return [n.addr, n.pid, n.local_id]


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_US = timedelta(microseconds=1)


def _time(t: datetime) -> int:
    """``t`` (timezone-aware, as torch's rendezvous keeps it) in microseconds since
    the epoch: exact both ways."""
    return (t - _EPOCH) // _US


def state_to_json(state: _RendezvousState) -> dict:
    """torch's rendezvous state as JSON data (raises TypeError on a field this
    version of distgrad does not know: a torch that added one needs a new mapping)."""
    fields = dict(vars(state))
    known = {"round", "complete", "deadline", "closed", "participants", "wait_list",
             "redundancy_list", "last_heartbeats"}
    if set(fields) - known:
        raise TypeError(f"torch's rendezvous state has fields distgrad cannot keep as JSON: "
                        f"{sorted(set(fields) - known)}")
    return {
        "round": state.round,
        "complete": state.complete,
        "deadline": None if state.deadline is None else _time(state.deadline),
        "closed": state.closed,
        "participants": sorted([*_node(n), r] for n, r in state.participants.items()),
        "wait_list": sorted(_node(n) for n in state.wait_list),
        "redundancy_list": sorted(_node(n) for n in getattr(state, "redundancy_list", ())),
        "last_heartbeats": sorted([*_node(n), _time(t)]
                                  for n, t in state.last_heartbeats.items()),
    }


class _Bad(ValueError):
    pass


def _int(v: Any, what: str) -> int:
    if type(v) is not int or not -2**63 <= v < 2**63:
        raise _Bad(f"{what}: expected an integer, found {v!r:.60}")
    return v


def _micros(v: Any, what: str) -> int:
    if type(v) is not int or not 0 <= v < 2**53:
        raise _Bad(f"{what}: expected a time in microseconds since 1970, found {v!r:.60}")
    return v


def _bool(v: Any, what: str) -> bool:
    if type(v) is not bool:
        raise _Bad(f"{what}: expected true or false, found {v!r:.60}")
    return v


def _list(v: Any, what: str, width: int) -> list:
    if type(v) is not list or len(v) > _MAX_NODES:
        raise _Bad(f"{what}: expected a list of at most {_MAX_NODES} entries")
    for e in v:
        if type(e) is not list or len(e) != width:
            raise _Bad(f"{what}: expected entries of {width} values, found {e!r:.60}")
    return v


def _desc(e: list, what: str) -> _NodeDesc:
    if type(e[0]) is not str or len(e[0]) > _MAX_ADDR:
        raise _Bad(f"{what}: a node's address must be a string of at most {_MAX_ADDR} characters")
    return _NodeDesc(e[0], _int(e[1], what), _int(e[2], what))


def _when(t: int) -> datetime:
    return _EPOCH + t * _US


def state_from_json(data: Any) -> _RendezvousState:
    """torch's rendezvous state from :func:`state_to_json`'s data; raises ValueError
    saying what is wrong with data that is not such a state."""
    if type(data) is not dict or set(data) != {"round", "complete", "deadline", "closed",
                                              "participants", "wait_list", "redundancy_list",
                                              "last_heartbeats"}:
        raise _Bad(f"not a rendezvous state: {data!r:.80}")
    state = _RendezvousState()
    state.round = _int(data["round"], "round")
    state.complete = _bool(data["complete"], "complete")
    deadline = data["deadline"]
    state.deadline = None if deadline is None else _when(_micros(deadline, "deadline"))
    state.closed = _bool(data["closed"], "closed")
    state.participants = {_desc(e, "participants"): _int(e[3], "participants")
                          for e in _list(data["participants"], "participants", 4)}
    state.wait_list = {_desc(e, "wait_list") for e in _list(data["wait_list"], "wait_list", 3)}
    redundant = {_desc(e, "redundancy_list")
                 for e in _list(data["redundancy_list"], "redundancy_list", 3)}
    if hasattr(state, "redundancy_list"):
        state.redundancy_list = redundant
    state.last_heartbeats = {_desc(e, "last_heartbeats"): _when(_micros(e[3], "last_heartbeats"))
                             for e in _list(data["last_heartbeats"], "last_heartbeats", 4)}
    return state


class _OwnStateUnpickler(pickle.Unpickler):
    """Loads the state torch's holder pickled in this process (set_state's input),
    and nothing but the classes such a state is made of."""

    _ALLOWED = {
        ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
        ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
        ("datetime", "datetime"), ("datetime", "timezone"), ("datetime", "timedelta"),
        ("builtins", "set"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"not part of a rendezvous state: {module}.{name}")
        return super().find_class(module, name)


def _own_state(bits: bytes) -> _RendezvousState:
    state = _OwnStateUnpickler(io.BytesIO(bits)).load()
    if not isinstance(state, _RendezvousState):
        raise RendezvousStateError(f"not a rendezvous state: {type(state).__name__}")
    return state
