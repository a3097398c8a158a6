"""The RPC agent: request ids -> futures, a worker thread pool, timeouts, replies.

One agent per process, reached through :func:`current_agent`. The agent speaks
to a :class:`~distgrad.transport.Transport` and to nothing lower; distributed
autograd and RRefs plug in through :class:`~.extensions.AgentExtension` objects.
Its parts: this module (sending, the in-order receiving, pending calls,
timeouts, lost peers), :mod:`.fast_path` (the frames of requests and replies,
fast layout or general), :mod:`.serving` (running requests, replying),
:mod:`.members` (a dynamic group's members: joined, left, lost),
:mod:`.pending` (the pending entry, RpcFuture, the current agent).

Example::

    >>> agent = current_agent()
    >>> agent.call("worker1", torch.add, (torch.ones(2), 1), {}, timeout=-1, sync=True)
    tensor([2., 2.])
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ..errors import DistgradError, ProtocolError, RPCTimeoutError, WorkerLostError
from ..transport import Transport
from ..wire import Kind, decode, dumps, encode, loads
from ..wire.fast_header import FAST_MAGIC, decode_fast, fast_header, grads_args
from ..wire.messages import peek_header, request_id
from .extensions import EXTENSION_TYPES, AgentExtension
from .fast_path import GRADIENT_RECEIVER, FastPath
from .members import Members
from .pending import _SEAL, RpcFuture, _holder, _Pending, _settle, agent_or_none, current_agent
from .pool import WorkerPool
from .serving import AsyncResult, AsyncReturnTypeError, Serving, UnknownFunctionError, _load_call
from .worker_info import WorkerInfo

__all__ = ["RpcAgent", "RpcFuture", "AsyncResult", "AsyncReturnTypeError", "UnknownFunctionError",
           "_Pending", "_holder", "_load_call", "_qualname", "agent_or_none", "current_agent"]

log = logging.getLogger(__name__)

# Calls with a timeout of at least this many seconds are failed by the periodic
# sweep (at most a heartbeat tick late); shorter ones get a timer of their own.
_SWEPT_TIMEOUT = 5.0
# Requests remembered per sender to serve each (sender, request id) at most once
# (a repeated CALL/REMOTE, e.g. from fault injection, is dropped).
_DEDUP_WINDOW = 1 << 16


class RpcAgent(FastPath, Serving, Members):
    """Sends requests, serves requests, tracks pending calls and lost peers."""

    def __init__(self, name: str, rank: int, world_size: int | None, workers: list[WorkerInfo],
                 transport: Transport, options: Any, incarnation: int = 1) -> None:
        self.name, self.rank = name, rank
        # a dynamic group (no world_size): members join and leave (see membership.py)
        self.dynamic = world_size is None
        self.world_size = len(workers) if world_size is None else world_size
        # every rank ever a member, by rank (its latest incarnation's WorkerInfo: names
        # in errors about members that left); by_name holds the current members only
        self.workers: dict[int, WorkerInfo] = {w.id: w for w in workers}
        self.info = self.workers[rank]
        self.by_name = {w.name: w for w in workers}
        self.departed: dict[str, int] = {}  # names of members that left or were lost -> rank
        self.leaving: set[int] = set()      # members that announced they leave (dynamic)
        self.group = None                   # the membership table (dynamic groups)
        self.admitted: dict[int, tuple] = {}  # rank -> (WorkerInfo, incarnation) being admitted
        self.incarnation = incarnation  # this process's under its rank (dynamic groups)
        self.incarnations: dict[int, int] = {}  # a dynamic group's members' incarnations
        # (wall time, "joined" | "left" | "lost", name, rank, incarnation): see membership_events()
        self.events: collections.deque = collections.deque(maxlen=4096)
        self.transport = transport
        self.options = options
        self.rpc_timeout = options.rpc_timeout
        self.pending: dict[int, _Pending] = {}
        self._swept = False  # a call waits on the sweep
        self.lost: dict[int, str] = {}
        self.left: set[int] = set()  # lost peers that said goodbye (shut down on purpose)
        self._rids = itertools.count(1)
        # the transport's reading threads serve requests (leader/followers); a
        # transport without its own pool gets a plain one
        self.pool = getattr(transport, "pool", None) or WorkerPool(
            options.num_worker_threads, thread_name_prefix=f"distgrad-{name}")
        self.callbacks = WorkerPool(max(4, options.num_worker_threads),
                                    thread_name_prefix=f"distgrad-cb-{name}")
        self.busy_threads = 0
        self.inflight = 0
        self._count_lock = threading.Lock()
        self.control_handlers: dict[str, Callable[[int, tuple], None]] = {}
        # Runs on the reading thread, in arrival order, for CALL/REMOTE messages whose
        # meta carries an ``extra`` (RRef bookkeeping that must not be overtaken
        # by later control messages); returns False when it already replied.
        self.pre_dispatch: Callable[[int, Any], bool] | None = None
        self._tls = threading.local()
        self.extensions: list[AgentExtension] = [f(self) for f in EXTENSION_TYPES]
        # decided once: the extensions that can put the calling thread in a context
        # (the others' ``current`` is the base class's None)
        self._ctx_exts = [e for e in self.extensions if type(e).current is not AgentExtension.current]
        # the fast layout for the common message (wire.fast_header); DISTGRAD_FAST_PATH=0
        # sends everything in the general one (the receiver reads both)
        self.fast = os.environ.get("DISTGRAD_FAST_PATH", "1") != "0"
        self.shutting_down = False
        self._seen_rids: dict[int, tuple[set, collections.deque]] = {}
        self.gil_wait: list | None = None  # [seconds, requests] while GIL profiling is on
        # device maps (rpc/devices.py install() sets them from the start-up exchange): this
        # worker's devices, its own maps (requests) and the reverse ones (replies), the
        # routes built from them, and the devices a received tensor may be placed on
        self.devices: list = []
        self.device_maps: dict = {}
        self.reverse_device_maps: dict = {}
        self.request_routes: dict = {}
        self.reply_routes: dict = {}
        self.device_targets: dict = {}

    # -- start/stop ----------------------------------------------------------
    def start(self, addresses: dict[int, str], **dynamic: Any) -> None:
        self.transport.start(self, addresses, **dynamic)

    # -- sending ---------------------------------------------------------------
    def resolve(self, to: Any) -> WorkerInfo:
        """WorkerInfo for a name, rank or WorkerInfo; ValueError when unknown."""
        if isinstance(to, WorkerInfo):
            if self.by_name.get(to.name) == to:
                return to
            self._check_departed(to.name)
            raise DistgradError(f"name:{self.name},rank:{self.rank} could not find destination {to}")
        if isinstance(to, str):
            info = self.by_name.get(to)
            if info is None:
                self._check_departed(to)
                raise DistgradError(f"name:{self.name},rank:{self.rank} could not find destination "
                                    f"name {to}")
            return info
        if isinstance(to, int) and not isinstance(to, bool):
            info = self.workers.get(to)
            if info is not None and self.by_name.get(info.name) is info:
                return info
            if info is not None:
                self._check_departed(info.name)
            raise DistgradError(f"name:{self.name},rank:{self.rank} could not find destination id "
                                f"{to} (world size {self.world_size})")
        raise ValueError(f"Cannot get WorkerInfo from name {to!r}: 'to' must be a worker name, rank or "
                         f"WorkerInfo, got {type(to).__name__}")

    def effective_timeout(self, timeout: float) -> float:
        if timeout is None or timeout < 0:
            return self.rpc_timeout
        return float(timeout)

    def send_request(self, dest: WorkerInfo, kind: Kind, payload_obj: Any, what: str,
                     timeout: float, sync: bool = False, extra: Any = None) -> _Pending:
        """Pickle and send a CALL/REMOTE; returns the pending entry (its future or lock)."""
        if self.shutting_down and kind != Kind.CALL:
            raise DistgradError(f"worker {self.name} is shutting down", self.name)
        ctx = self._current_ctx()
        rid = next(self._rids)
        frames = self._request_frames(dest, kind, rid, payload_obj, what, extra, ctx)
        timeout = self.effective_timeout(timeout)
        p = _Pending(dest.id, what, timeout, sync, ctx, self.devices)
        if dest.id in self.lost:
            self._fail(p, self._lost_error(dest.id))
            return p
        if dest.id in self.leaving:
            self._fail(p, WorkerLostError(f"worker {dest.name} (rank {dest.id}) is leaving the group "
                                          f"(shutdown): {what} was not sent", dest.name))
            return p
        self.pending[rid] = p
        if timeout > 0:
            if timeout >= _SWEPT_TIMEOUT:  # checked by the periodic sweep: no timer per call
                p.deadline = time.monotonic() + timeout
                self._swept = True
            else:
                p.timer = self.transport.call_later(timeout, lambda: self._expire(rid), wake=False)
        # a small sync call takes the connection's reading role before it sends: its
        # reply then wakes this thread, and no other (see SocketTransport.claim)
        claim = getattr(self.transport, "claim", None)
        if sync and claim is not None and len(frames) < 3 and len(frames[-1]) < 65536:
            p.claimed = claim(dest.id)
        try:
            self.transport.send(dest.id, frames)
        except BaseException:
            if p.claimed:
                p.claimed = False
                self.transport.release(dest.id)
            raise
        return p

    def call(self, to: Any, func: Callable, args: tuple, kwargs: dict, timeout: float,
             sync: bool) -> Any:
        """rpc_sync (``sync=True``: returns the value) or rpc_async (returns a Future)."""
        dest = self.resolve(to)
        what = _qualname(func)
        p = self.send_request(dest, Kind.CALL, (func, tuple(args or ()), kwargs or {}), what,
                              timeout, sync)
        return self.wait(p) if sync else p.future

    def wait(self, p: _Pending) -> Any:
        """Block until a sync pending call finishes; decode its reply here."""
        if not p.lock.acquire(False):
            # read the reply on this thread when nobody else reads that connection
            read_until = getattr(self.transport, "read_until", None)
            if read_until is not None:
                timer = p.timer   # (when its timeout completes it, on another thread)
                read_until(p.peer, lambda: p.result is not None, claimed=p.claimed,
                           look_at=None if timer is None else timer.when)
            p.lock.acquire()
        elif p.claimed:
            self.transport.release(p.peer)
        kind, value = p.result
        if kind is None:
            raise value
        return self._decode_reply(p, kind, value)

    def read_reply(self, p: _Pending) -> None:
        """Wait for the reply of an rpc_async call on this thread, reading it here
        when nobody else reads that connection; its future is then completed on a
        pool thread (the caller's ``wait()`` waits for that)."""
        read_until = getattr(self.transport, "read_until", None)
        if read_until is None:
            return
        p.reader = threading.get_ident()
        try:
            timer = p.timer
            read_until(p.peer, lambda: p.result is not None or p.future.done(),
                       look_at=None if timer is None else timer.when)
        finally:
            p.reader = None
        result, p.result = p.result, None
        if result is not None:
            # Completed (decoded, then set) on a pool thread, which wakes this waiter
            # and then runs the future's callbacks there, as torch completes every
            # reply on its RPC threads: never here, inside wait(), where the waiter
            # may hold what a callback needs. Always, not only when then() or
            # add_done_callback() marked it: a callback registered in C++
            # (torch.futures.collect_all, wait_all, torch._C.Future.then) cannot be
            # seen, and torch.futures.Future does not tell whether it has any.
            # rpc_sync does not come here (agent.wait: no future, no hand-off).
            # submit_now: this waiter blocks until it runs, so it must not queue
            # behind callbacks that themselves wait in such a wait().
            self.callbacks.submit_now(self._finish_own, p, result)

    def abandon(self, future: torch.futures.Future, why: str) -> None:
        """Stop waiting for the reply of the rpc_async call whose future is
        ``future`` (it fails with ``why``); a late reply is then ignored."""
        for rid, p in list(self.pending.items()):
            if p.future is future and self.pending.pop(rid, None) is not None:
                if p.timer is not None:
                    p.timer.cancel()
                self._fail(p, DistgradError(why, self.workers[p.peer].name))

    def notify(self, to: Any, func: Callable, args: tuple = (), kwargs: dict | None = None,
               reverse: bool = False) -> bool:
        """One-way request: ``func(*args, **kwargs)`` runs on the receiver's pool and
        nothing is sent back (its errors are logged there). Returns False, sending
        nothing, when ``to`` is known to be lost. Pickling errors raise here.
        ``reverse``: device tensors go through the reverse map to ``to`` (a gradient
        for a request's tensors goes back as the reply would)."""
        dest = self.resolve(to)
        rid = next(self._rids)
        ctx = self._current_ctx()
        frames = None
        if func is GRADIENT_RECEIVER[0] and ctx is None and not kwargs and self.fast:
            frames = self._gradient_frames(dest, rid, tuple(args), reverse)   # no pickle
        if frames is None:
            frames = self._request_frames(dest, Kind.NOTIFY, rid, (func, tuple(args), kwargs or {}),
                                          _qualname(func), None, ctx, reverse)
        if dest.id in self.lost:
            return False
        self.transport.send(dest.id, frames)
        return True

    def send_control(self, dest: int, op: str, *args: Any, soon: bool = False) -> None:
        """One-way message handled in order on the receiver's reading thread; with
        ``soon``, it goes with the next message to ``dest``, at the latest at the
        transport's next tick (:meth:`~distgrad.transport.sending.Sending.send_soon`)."""
        if dest in self.lost:
            return
        payload, _ = dumps((op, args))
        frames = encode(Kind.CONTROL, 0, None, payload)
        if soon:
            self.transport.send_soon(dest, frames)
        else:
            self.transport.send(dest, frames)

    # -- receiving (the reading thread, in order per peer) ---------------------
    def on_message(self, peer: int, frames: list) -> tuple | None:
        """Handle what must happen in arrival order; return the work (``(fn, args)``)
        the reading thread runs once another thread reads in its place."""
        env = frames[0] if frames else b""
        fast = (env[:2] == FAST_MAGIC) if type(env) is bytearray else None
        try:
            # peek_header, inlined for the common fast envelope in a bytearray
            header = fast_header(frames) if fast else None
            kind, rid, _ = header if fast else peek_header(frames)
        except ProtocolError as e:
            log.warning("worker %s: dropped a malformed message from worker %d: %s", self.name, peer, e)
            rid = request_id(frames)
            if rid is not None:  # a request whose header decoded: tell the caller
                self._send_error(peer, rid, e, None)
            return
        if kind in (Kind.REPLY, Kind.ERROR):
            p = self.pending.pop(rid, None)
            if p is None:
                return  # late (timed out) or duplicated reply
            if p.timer is not None:
                p.timer.cancel()
            if p.lock is not None:  # a waiting caller: wake it, it decodes
                p.result = (kind, frames)
                p.lock.release()
                return None
            if p.reader == threading.get_ident():  # read by its waiter, who completes it
                p.result = (kind, frames)
                return None
            if p.future.__dict__.get("_dg_user"):  # callbacks to run: a thread of its own
                return (self._finish_own, (p, (kind, frames)))
            return (self._finish_async, (p, (kind, frames)))
        if kind != Kind.CONTROL and self._repeated(peer, rid):
            log.debug("worker %s: dropped a repeated request %d from worker %d", self.name, rid, peer)
            return
        try:
            msg = decode_fast(frames, peer, header) if fast else decode(frames, peer)
        except ProtocolError as e:
            log.warning("worker %s: malformed message from worker %d: %s", self.name, peer, e)
            if kind in (Kind.CALL, Kind.REMOTE):
                self._send_error(peer, rid, e, None)
            return
        if kind == Kind.CONTROL:
            self._on_control(peer, msg)
            return
        if kind == Kind.GRADS:   # (fast layout only) gradients for the gradient function
            receiver = GRADIENT_RECEIVER[0]
            try:
                if receiver is None:
                    raise ProtocolError("gradients for a worker without distributed autograd")
                msg.call = (receiver, grads_args(msg), {})
            except ProtocolError as e:
                log.warning("worker %s: malformed message from worker %d: %s", self.name, peer, e)
                return
            msg.kind = Kind.NOTIFY   # served as the NOTIFY it replaces: no reply, errors logged
            msg.meta = (_qualname(receiver), None, None)
        if not (isinstance(msg.meta, tuple) and len(msg.meta) == 3):
            log.warning("worker %s: malformed request meta from worker %d", self.name, peer)
            self._send_error(peer, rid, ProtocolError("malformed request meta"), None)
            return
        if msg.meta[2] is not None and self.pre_dispatch is not None:
            try:
                if not self.pre_dispatch(peer, msg):
                    return
            except Exception as e:  # noqa: BLE001
                self._send_error(peer, rid, e, None)
                return
        with self._count_lock:
            self.inflight += 1
        if self.gil_wait is not None:
            msg.handed_off = time.perf_counter()
        return (self._serve, (peer, msg))

    def _repeated(self, peer: int, rid: int) -> bool:
        """Whether request ``rid`` of ``peer`` was seen among its last _DEDUP_WINDOW
        requests (reading thread only). Request ids come from one counter per agent
        and are never reused, so a repeat is a duplicate: at most once."""
        seen = self._seen_rids.get(peer)
        if seen is None:
            seen = self._seen_rids[peer] = (set(), collections.deque())
        ids, order = seen
        if rid in ids:
            return True
        ids.add(rid)
        order.append(rid)
        if len(order) > _DEDUP_WINDOW:
            ids.discard(order.popleft())
        return False

    def _on_control(self, peer: int, msg) -> None:
        try:
            op, args = loads(msg.payload)
            self.control_handlers[op](peer, *args)
        except Exception:
            log.exception("worker %s: bad control message from worker %d", self.name, peer)

    def on_peer_lost(self, peer: int, reason: str, graceful: bool) -> None:
        self.lost[peer] = reason
        if graceful:
            self.left.add(peer)
        if not graceful or not self.shutting_down:
            log.log(logging.INFO if graceful else logging.WARNING, "worker %s: lost worker %s: %s",
                    self.name, self.workers[peer].name, reason)
        err = self._lost_error(peer)
        for rid, p in list(self.pending.items()):
            if p.peer == peer and self.pending.pop(rid, None) is not None:
                if p.timer is not None:
                    p.timer.cancel()
                self._fail(p, err)
        for ext in self.extensions:
            try:
                ext.on_peer_lost(peer, reason)
            except Exception:
                log.exception("extension failed handling the loss of worker %d", peer)
        if self.dynamic and not self.shutting_down:
            self.remove_member(peer, "left" if graceful else "lost")
            if not graceful and self.group is not None:
                # the survivors take a crashed member out of the table (off this thread:
                # the store may be slow); only the incarnation that was lost
                self.callbacks.submit(self._untable, peer, self.incarnations.get(peer))

    def on_send_failed(self, peer: int, messages: list, error: BaseException) -> None:
        """Transport callback: ``messages`` to ``peer`` were dropped unsent (``error``
        raised while the transport sealed them; the connection stays). A call among
        them fails with an error naming the peer; a reply is replaced by an error
        reply, so the caller there does not wait for its timeout; anything else
        (one-way messages) is logged."""
        w = self.workers.get(peer)
        to = f"worker {w.name} (rank {peer})" if w is not None else f"rank {peer}"
        for frames in messages:
            try:
                kind, rid, _ = peek_header(frames)
            except ProtocolError:
                kind, rid = None, 0
            p = self.pending.pop(rid, None) if kind in (Kind.CALL, Kind.REMOTE) else None
            if p is not None:
                if p.timer is not None:
                    p.timer.cancel()
                err = DistgradError(f"{p.what} could not be sent to {to}: {type(error).__name__}: "
                                    f"{error}", w.name if w is not None else None)
                err.__cause__ = error
                self._fail(p, err)
            elif kind == Kind.REPLY:
                self._send_error(peer, rid, DistgradError(
                    f"worker {self.name} could not send its reply to {to}: "
                    f"{type(error).__name__}: {error}", self.name), None)
            else:
                log.error("worker %s: a message (%s) to %s was dropped unsent: %r", self.name,
                          getattr(kind, "name", "unknown kind"), to, error)

    def _lost_error(self, peer: int) -> WorkerLostError:
        w = self.workers[peer]
        return WorkerLostError(f"worker {w.name} (rank {w.id}) is lost: {self.lost[peer]}", w.name)

    def on_tick(self, now: float) -> None:
        """Called by the transport a few times a second (its heartbeat tick): fail
        the calls past their deadline (long timeouts are checked here, not by a
        timer each: at most one tick late, and nothing to cancel per reply)."""
        if not self._swept:
            return
        late = [rid for rid, p in list(self.pending.items()) if p.deadline and p.deadline <= now]
        for rid in late:
            self._expire(rid)

    def _expire(self, rid: int) -> None:
        p = self.pending.pop(rid, None)
        if p is None:
            return
        w = self.workers[p.peer]
        self._fail(p, RPCTimeoutError(
            f"RPC ran for more than set timeout ({p.timeout * 1000:.0f} ms) and will now be marked "
            f"with an error: call to {p.what} on worker {w.name} (rank {w.id}) got no reply within "
            f"{p.timeout:g} s", w.name))

    def _complete(self, p: _Pending, result: tuple) -> None:
        if p.lock is not None:
            p.result = result
            p.lock.release()
        else:
            self.callbacks.submit(self._finish_own, p, result)

    def _fail(self, p: _Pending, exc: BaseException) -> None:
        self._complete(p, (None, exc))

    def _outcome(self, p: _Pending, result: tuple) -> tuple:
        """(value, exception) of a reply for ``p``'s future."""
        p.future.__dict__.pop("_dg_pending", None)
        kind, value = result
        if kind is None:
            return None, value
        try:
            return self._decode_reply(p, kind, value), None
        except BaseException as e:  # noqa: BLE001 - the future carries it
            return None, e

    def _finish_own(self, p: _Pending, result: tuple) -> None:
        """Complete ``p``'s future on this thread, running its callbacks here: a
        thread nothing else waits behind (a task of its own, the caller that
        waits for it)."""
        _settle(p.future, *self._outcome(p, result))

    def _finish_async(self, p: _Pending, result: tuple) -> None:
        """Complete ``p``'s future on a reading thread, where several reply
        completions may run in turn: only while it has no callback seen from Python
        (checked and sealed against a concurrent ``then``, see RpcFuture); one that
        has is completed on a thread of its own, as torch completes every reply (a
        callback may wait for a reply behind it on this thread). Never the waiter's
        own reply (see read_reply). A callback registered in C++ runs here: the
        reading thread runs only the first completion of a read, and queues the
        rest (leader.py, ``_split``)."""
        value, exc = self._outcome(p, result)
        fut = p.future
        d = fut.__dict__
        with _SEAL:
            user = d.get("_dg_user", False)
            if not user:
                d["_dg_sealed"] = True
        if user:
            self.callbacks.submit(_settle, fut, value, exc)
        else:
            _settle(fut, value, exc)

    # completing a reply with no callback runs no user function: a reading thread
    # runs several of one read in turn, waking nobody (leader.py)
    _finish_async.batchable = True

    # -- introspection --------------------------------------------------------

    def debug_info(self) -> dict[str, Any]:
        stats = getattr(self.transport, "stats", {})
        info: dict[str, Any] = {
            "agent.num_pending_requests": len(self.pending),
            "agent.num_inflight_requests": self.inflight,
            "agent.thread_pool_size": self.options.num_worker_threads,
            "agent.num_busy_threads": self.busy_threads,
            "agent.num_idle_threads": self.options.num_worker_threads - self.busy_threads,
            "agent.lost_workers": {self.workers[p].name: r for p, r in self.lost.items()
                                   if p in self.workers},
        }
        if self.devices:   # device tensors staged through host memory, per direction and device
            from ..wire.devices import STAGED
            info["agent.device_bytes_to_host"] = dict(STAGED["to_host"])
            info["agent.device_bytes_from_host"] = dict(STAGED["from_host"])
        if self.gil_wait is not None:
            total, n = self.gil_wait
            info["agent.gil_average_wait_time_us"] = str(int(total / n * 1e6) if n else 0)
        link_info = getattr(self.transport, "link_info", None)
        for peer, (ms, bs, mr, br, *_) in sorted(stats.items()):
            if peer not in self.workers:
                continue
            name = self.workers[peer].name
            info[f"peer.{name}"] = {"messages_sent": ms, "bytes_sent": bs,
                                    "messages_received": mr, "bytes_received": br}
            if link_info is not None and peer != self.rank:
                info[f"peer.{name}"].update(link_info(peer))
        return info

    def get_worker_info(self, worker_name: Any = None) -> WorkerInfo:
        """This worker's WorkerInfo, or that of ``worker_name`` (torch's agent API)."""
        return self.info if worker_name is None else self.resolve(worker_name)

    def get_worker_infos(self) -> list[WorkerInfo]:
        """Every member's WorkerInfo, by rank (in a dynamic group: the members now)."""
        return sorted(self.by_name.values(), key=lambda w: w.id)

    def _get_device_map(self, dst: WorkerInfo) -> dict:
        """This worker's device map to ``dst`` (torch's agent API; {} when none)."""
        return dict(self.device_maps.get(dst.name, {}))

    def get_debug_info(self) -> dict[str, Any]:
        """The agent's own counters (torch's agent API; see rpc._get_debug_info)."""
        return self.debug_info()

    def set_gil_profiling(self, flag: bool) -> None:
        self.gil_wait = [0.0, 0] if flag else None

    def current_request(self):
        """The message being served on this pool thread (None elsewhere)."""
        return getattr(self._tls, "msg", None)

    def idle(self) -> bool:
        return not self.pending and self.inflight == 0


def _qualname(func: Any) -> str:
    mod = getattr(func, "__module__", None) or ""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    return f"{mod}.{name}" if mod else name


