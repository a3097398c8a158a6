"""Fault injection for tests: drop, delay or duplicate outgoing messages, or
kill this worker at a chosen message. Never on by default.

Enable it in a worker with the environment variable ``DISTGRAD_FAULTS`` (a JSON
object), or by setting ``opts.faults`` (the same object, as a dict or JSON
string) on the :class:`~distgrad.rpc.RpcBackendOptions` passed to ``init_rpc``;
``init_rpc`` then builds a :class:`FaultyTransport` instead of the plain
:class:`~distgrad.transport.SocketTransport`. A warning is logged when it is on.

Faults act on this worker's *send* path only (``Transport.send``), on agent
messages (heartbeats and goodbyes are never touched, so peer-loss detection is
unaffected). The transport reads nothing but the message kind from the header
frame, through the ``peek_kind`` it is given (RPC gives the wire's
:func:`distgrad.wire.messages.peek_header`; the transport, a floor below the wire,
never imports it); it never unpickles.

Format: each key is an action, its value one rule or a list of rules::

    DISTGRAD_FAULTS='{
      "drop":      {"kinds": ["REPLY"], "peers": [1], "prob": 1.0},
      "delay":     {"kinds": ["CALL"], "seconds": 2},
      "duplicate": {"kinds": ["REPLY", "CALL"], "copies": 1},
      "kill_at":   {"kind": "CALL", "count": 5, "exit_code": 9},
      "seed": 0
    }'

Rule fields (all optional):

``kinds`` (or ``kind``)
    message kind names from :class:`distgrad.wire.messages.Kind` (``CALL``,
    ``REMOTE``, ``REPLY``, ``ERROR``, ``CONTROL``); default: every kind.
``peers``
    destination ranks; default: every peer (calls to self included).
``ranks``
    ranks of *this* worker the rule applies to (handy when the same options
    reach every worker); default: all.
``prob``
    probability of acting on a matching message (default 1.0; ``seed`` at
    the top level makes it reproducible).
``skip``
    let the first ``skip`` matching messages through untouched (default 0).
``limit``
    act on at most ``limit`` messages (default: no limit).

Action parameters: ``delay.seconds`` (default 1.0; the message is sent from
an I/O-thread timer, so later messages may overtake it), ``duplicate.copies``
(extra copies, default 1), ``kill_at.count`` (the worker calls
``os._exit(exit_code)`` — default 9 — instead of sending the ``count``-th
matching message, 1-based; default 1). One message can match several rules:
kill first, then drop, else delay and/or duplicate.

What the receiver does with faulty traffic:

* a dropped request or reply: the call times out with ``RPCTimeoutError``
  naming the worker and the function (with timeout 0 it waits until the
  peer is lost or RPC shuts down);
* a late or duplicated ``REPLY``/``ERROR``: ignored (its request id is no
  longer pending; request ids come from a per-agent counter and are never
  reused);
* a duplicated ``CALL``/``REMOTE``: served at most once; the callee remembers
  the last request ids of each sender (see ``RpcAgent.on_message``) and drops
  repeats;
* a duplicated ``CONTROL`` message is *not* deduplicated (control messages
  carry no request id) and would confuse RRef fork counting: do not
  duplicate ``CONTROL`` unless that is what the test is about.

Duplicates are new messages to the transport (with a cluster secret each copy
gets its own sequence number), i.e. they model a sender repeating itself, not
a network replay (which authentication rejects).
"""
from __future__ import annotations

import json
import logging
import os
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import ProtocolError
from .socket_transport import SocketTransport

log = logging.getLogger(__name__)

ENV_VAR = "DISTGRAD_FAULTS"
_ACTIONS = ("kill_at", "drop", "delay", "duplicate")


class _Rule:
    __slots__ = ("action", "kinds", "peers", "prob", "skip", "limit", "seconds", "copies",
                 "count", "exit_code", "seen", "acted")

    def __init__(self, action: str, spec: Mapping[str, Any], kinds: Any) -> None:
        known = {"kinds", "kind", "peers", "ranks", "prob", "skip", "limit", "seconds", "copies",
                 "count", "exit_code"}
        unknown = set(spec) - known
        if unknown:
            raise ValueError(f"{ENV_VAR}: unknown field(s) {sorted(unknown)} in rule {action!r}")
        names = spec.get("kinds", spec.get("kind"))
        if isinstance(names, str):
            names = [names]
        try:
            self.kinds = None if names is None else frozenset(int(kinds[k.upper()]) for k in names)
        except KeyError as e:
            raise ValueError(f"{ENV_VAR}: unknown message kind {e} (known: "
                             f"{[k.name for k in kinds]})") from None
        peers = spec.get("peers")
        self.peers = None if peers is None else frozenset(int(p) for p in peers)
        self.action = action
        self.prob = float(spec.get("prob", 1.0))
        self.skip = int(spec.get("skip", 0))
        self.limit = spec.get("limit")
        self.seconds = float(spec.get("seconds", 1.0))
        self.copies = int(spec.get("copies", 1))
        self.count = int(spec.get("count", 1))
        self.exit_code = int(spec.get("exit_code", 9))
        self.seen = 0   # matching messages so far
        self.acted = 0  # messages acted on so far

    def matches(self, kind: int, peer: int) -> bool:
        return (self.kinds is None or kind in self.kinds) and (self.peers is None or peer in self.peers)


def parse(config: Any, rank: int, kinds: Any) -> list[_Rule]:
    """Rules of ``config`` (dict or JSON string) that apply to worker ``rank``; ``kinds``
    names the message kinds (an ``IntEnum`` such as :class:`distgrad.wire.Kind`).

    Example::

        >>> [r.action for r in parse({"drop": {"kinds": ["REPLY"]}}, 0, Kind)]
        ['drop']
    """
    if isinstance(config, (str, bytes)):
        config = json.loads(config)
    if not isinstance(config, Mapping):
        raise ValueError(f"{ENV_VAR} must be a JSON object, got {type(config).__name__}")
    unknown = set(config) - set(_ACTIONS) - {"seed"}
    if unknown:
        raise ValueError(f"{ENV_VAR}: unknown action(s) {sorted(unknown)}; known: {list(_ACTIONS)}")
    rules = []
    for action in _ACTIONS:
        specs = config.get(action)
        if specs is None:
            continue
        for spec in specs if isinstance(specs, list) else [specs]:
            ranks = spec.get("ranks")
            if ranks is not None and rank not in ranks:
                continue
            rules.append(_Rule(action, {k: v for k, v in spec.items() if k != "ranks"}, kinds))
    return rules


def config_from(options: Any = None) -> Any:
    """The fault configuration from ``options.faults`` or ``$DISTGRAD_FAULTS``; None when off."""
    cfg = getattr(options, "faults", None) if options is not None else None
    if cfg is None:
        cfg = os.environ.get(ENV_VAR) or None
    return cfg


class FaultyTransport(SocketTransport):
    """A :class:`SocketTransport` whose ``send`` misbehaves as configured (see the module).

    ``kinds`` names the message kinds (an ``IntEnum``), ``peek_kind(frames)`` reads a
    message's kind from its frames (raising :class:`~distgrad.errors.ProtocolError` for
    frames that are no message): what the wire, a floor above, knows.

    Example (what ``init_rpc`` builds when faults are configured)::

        >>> t = FaultyTransport(0, faults={"drop": {"kinds": ["REPLY"]}}, kinds=Kind,
        ...                     peek_kind=lambda frames: peek_header(frames)[0])
    """

    def __init__(self, rank: int, *args: Any, faults: Any, kinds: Any,
                 peek_kind: Callable[[Sequence], int], **kwargs: Any) -> None:
        super().__init__(rank, *args, **kwargs)
        cfg = json.loads(faults) if isinstance(faults, (str, bytes)) else dict(faults)
        self._kinds = kinds
        self._peek_kind = peek_kind
        self.fault_rules = parse(cfg, rank, kinds)
        self._rng = random.Random(cfg.get("seed"))
        self._fault_lock = threading.Lock()
        self.fault_stats = {"dropped": 0, "delayed": 0, "duplicated": 0}
        log.warning("worker %d: fault injection is ON (%s): %s", rank, ENV_VAR, cfg)

    def send_soon(self, peer: int, frames: Sequence) -> None:
        """At once, through :meth:`send` (the rules see every message as it is sent)."""
        self.send(peer, frames)

    def send(self, peer: int, frames: Sequence) -> None:
        try:
            kind = self._peek_kind(frames)
        except ProtocolError:
            super().send(peer, frames)
            return
        drop = kill = False
        delay = 0.0
        copies = 0
        with self._fault_lock:
            for r in self.fault_rules:
                if not r.matches(kind, peer):
                    continue
                r.seen += 1
                if r.action == "kill_at":
                    if r.seen == r.count:
                        kill = r.exit_code
                    continue
                if r.seen <= r.skip or (r.limit is not None and r.acted >= r.limit):
                    continue
                if r.prob < 1.0 and self._rng.random() >= r.prob:
                    continue
                r.acted += 1
                if r.action == "drop":
                    drop = True
                elif r.action == "delay":
                    delay = max(delay, r.seconds)
                else:
                    copies += r.copies
            if drop:
                self.fault_stats["dropped"] += 1
            else:
                self.fault_stats["delayed"] += bool(delay)
                self.fault_stats["duplicated"] += copies
        if kill is not False:
            log.warning("worker %d: fault injection: exiting at %s message to worker %d",
                        self.rank, self._kinds(kind).name, peer)
            for h in logging.getLogger().handlers:
                try:
                    h.flush()
                except Exception:  # noqa: BLE001
                    pass
            os._exit(kill)
        if drop:
            return
        send = super().send
        for _ in range(1 + copies):
            if delay > 0:
                self.call_later(delay, lambda: send(peer, frames))
            else:
                send(peer, frames)
