"""Hostile and broken input on real workers: they survive, keep serving, and
their memory does not blow up.

torch's RPC dies from 64 KiB of garbage on its port and stops accepting after
a bare connect-and-close; distgrad must not. Rank 0 drives every attack
against every worker's listening sockets (TCP and Unix; itself included):
garbage, broken or forged handshakes (tests/raw_peer.py), huge declared
sizes, hundreds of bare and idle connections, and clients that know the
secret but claim a rank already connected and then send messages. A worker
refuses every connection after start-up, so none of it is ever read as a
message: nothing is unpickled (a marker file is never created). Then it checks
that rpc_sync works between all pairs and that no worker's resident memory
grew by more than ``RSS_GROWTH_MIB``.

Second part: an *authenticated* peer (the agent's own transport, so frames are
MAC'd) sends malformed distgrad messages (truncated header, wrong buffer
counts, absurd tensor shapes, malformed or oversized-declaring meta pickles);
the receiver survives, allocates nothing for declared sizes, and a CALL whose
header decoded gets a ProtocolError (or SerializationError) reply.
"""
import os
import pickle
import struct
import time

import pytest
import raw_peer as rp
import torch
from mp_utils import run_workers

pytestmark = pytest.mark.timeout(240)

RSS_GROWTH_MIB = 300


# -- helpers (run inside rank 0) ----------------------------------------------
def _endpoints(agent, world_size):
    """(worker rank, TCP address or Unix socket name) of every listening socket."""
    return [(r, t) for r in range(world_size) for t in rp.targets(agent, r)]


class _MakeFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _pid():
    return os.getpid()


def _alive(x):
    return x


def _ping_all(world_size, nbytes):
    """Runs on one worker: rpc_sync to every other worker with an nbytes tensor."""
    import distgrad.rpc as rpc
    me = rpc.get_worker_info().id
    t = torch.ones(nbytes // 4)
    for r in range(world_size):
        if r != me:
            out = rpc.rpc_sync(f"worker{r}", torch.add, args=(t, 1), timeout=30)
            assert out.shape == t.shape and float(out[0]) == 2.0 and float(out[-1]) == 2.0
    return True


def _check_all_pairs(world_size, nbytes):
    import distgrad.rpc as rpc
    for r in range(world_size):
        assert rpc.rpc_sync(f"worker{r}", _ping_all, args=(world_size, nbytes), timeout=60) is True


def _raw(target, data=b"", hold=0.0):
    try:
        s = rp.connect(target)
    except OSError:
        return  # the backlog is full for a moment: an attack that did nothing
    try:
        if data:
            rp.send_quietly(s, data)
        if hold:
            time.sleep(hold)
    finally:
        s.close()


def _raw_attacks(eps):
    rng = os.urandom
    for rank, target in eps:
        _raw(target, rng(64 * 1024))                                   # pure garbage
        _raw(target, rp.MAGIC + rng(64 * 1024))                        # the magic, then garbage
        _raw(target, rp.hello(0, rank + 1, rp.F_SECRET) + rng(1024))   # asks for another worker
        _raw(target, rp.hello(2**32 - 1, rank, 0xFF) + rng(1024))      # absurd rank and flags
        _raw(target, rp.hello(0, rank, rp.F_SECRET) + rng(64 * 1024))  # garbage for a proof
        _raw(target, rp.hello(0, rank, 0) + rng(64 * 1024))            # no secret
        for size in (2**62, 2**63 - 1, 2**32):                         # huge sizes for a proof
            _raw(target, rp.hello(0, rank, rp.F_SECRET) + struct.pack("!IQ", 1, size) + rng(1024))
        _raw(target, rp.hello(0, rank, rp.F_SECRET)[:20])              # a torn hello
        for _ in range(200 if isinstance(target, tuple) else 50):      # bare connect-and-close
            _raw(target)


def _idle_connections(eps, n=200):
    held = []
    for _, target in eps:
        for _ in range(n if isinstance(target, tuple) else n // 4):
            try:
                held.append(rp.connect(target))
            except OSError:
                pass  # the backlog is full for a moment
    return held


def _handshake_attacks(eps, marker, secret, big=0):
    """Clients that know the secret and pass their proof, claiming a rank already
    connected (or none of the cluster), then send messages: refused with a
    verdict ("not expected"), never read."""
    from distgrad.transport.handshake import HandshakeError, Refused, client_handshake
    from distgrad.wire.messages import Kind, encode
    call = encode(Kind.CALL, 1, ("x", None, None), pickle.dumps((_MakeFile(marker), (), {})))
    messages = b"".join(rp.framed(m) for m in (
        call, [b"\x00" * 28, *call], [b"\xffHB"], [b"\xffBYE"], [b""], [b"x"] * 1000,
        [os.urandom(100) for _ in range(5)]))
    if big:
        messages += rp.framed([bytes(28), os.urandom(big)])
    closed = passed = 0
    for rank, target in eps:
        for claim in (0, 1, 7, 2**32 - 1):
            try:
                s = rp.connect(target)
            except OSError:
                continue
            try:
                client_handshake(s, claim, rank, secret, False, mac_all=not isinstance(target, str))
            except Refused as e:  # the proof passed; the rank was refused
                passed += "does not expect" in str(e)
                rp.send_quietly(s, messages)
                closed += rp.closed_by_peer(s)
            except (HandshakeError, OSError):
                closed += 1  # refused before the end of the handshake (too many at once)
            finally:
                s.close()
    time.sleep(0.5)
    return closed, passed


def _hostile(rank, world_size, nbytes, big, marker):
    import distgrad.rpc as rpc
    if rank != 0:
        return None
    agent = rpc.api.current_agent()
    eps = _endpoints(agent, world_size)
    pids = [rpc.rpc_sync(f"worker{r}", _pid) for r in range(world_size)]
    _check_all_pairs(world_size, nbytes)  # warm up (buffers, pools) before measuring
    before = [_rss_mib(p) for p in pids]
    _raw_attacks(eps)
    time.sleep(0.5)
    # every one hung up on, after passing its proof (refused as a rank not expected)
    secret = agent.transport._secret  # as the transport keys from it (stretched)
    assert _handshake_attacks(eps, marker, secret, big) == (4 * len(eps), 4 * len(eps))
    held = _idle_connections(eps)
    try:
        _check_all_pairs(world_size, nbytes)  # serving while hundreds of idle connections are held
        _raw_attacks(eps)
    finally:
        for s in held:
            s.close()
    time.sleep(0.5)
    _check_all_pairs(world_size, nbytes)
    after = [_rss_mib(p) for p in pids]
    for r, (b, a) in enumerate(zip(before, after)):
        assert a - b < RSS_GROWTH_MIB, f"worker{r} RSS grew {b:.0f} -> {a:.0f} MiB"
    assert not os.path.exists(marker)
    return before, after


def test_hostile_network_input_default_limits(tmp_path):
    marker = str(tmp_path / "pwned")
    res = run_workers(_hostile, world_size=3, timeout=200, args=(2 << 20, 0, marker))
    before, after = res[0]
    print("RSS MiB before/after:", [f"{b:.0f}/{a:.0f}" for b, a in zip(before, after)])
    assert not os.path.exists(marker)




# -- authenticated peer, malformed messages ------------------------------------
class _RefPickler(pickle.Pickler):
    def persistent_id(self, obj):
        return 5 if obj == "T" else None  # a tensor index the message does not have


def _pickle_with_ref(obj):
    import io
    buf = io.BytesIO()
    _RefPickler(buf, protocol=5).dump(obj)
    return buf.getvalue()


def _bad_frames(agent_rid):
    from distgrad.wire.messages import HEADER, MAGIC, VERSION, Kind, encode
    from distgrad.wire.pickler import dumps
    payload, tensors = dumps((torch.numel, (torch.ones(4),), {}))
    good = [bytes(memoryview(f)) for f in encode(Kind.CALL, 0, ("torch.numel", None, None),
                                                    payload, tensors)]
    good_meta = good[0][HEADER.size:HEADER.size + HEADER.unpack_from(good[0])[-1]]
    buf = good[1]

    def env(m, p, nbuf, meta_len=None):
        n = len(m) if meta_len is None else meta_len
        return HEADER.pack(MAGIC, VERSION, int(Kind.CALL), nbuf, 0, n) + m + p

    def meta(specs, m=("torch.numel", None, None)):
        return pickle.dumps((m, specs), protocol=5)

    cases = {}  # name -> (frames, whether an error reply is expected)
    cases["truncated header"] = ([good[0][:7], *good[1:]], False)
    cases["empty message"] = ([b""], False)
    for name, frames in {
        "too few buffers": [env(good_meta, payload, 3), buf],
        "too many buffers": [env(good_meta, payload, 0), buf],
        "meta length beyond the envelope": [env(good_meta, b"", 1, meta_len=10**6), buf],
        "garbage meta": [env(b"\x80\x05garbage", payload, 1), buf],
        "meta declares 2**62 bytes": [env(b"\x80\x05\x8e" + struct.pack("<Q", 2**62), payload, 1),
                                      buf],
        "meta not a pair": [env(pickle.dumps(42), payload, 1), buf],
        "meta not a 3-tuple": [env(meta((("torch.float32", (4,), False, 0),), m="x"), payload, 1),
                               buf],
        "specs not a tuple": [env(meta("nope"), payload, 1), buf],
        "shape 2**40, no buffer": [env(meta((("torch.float32", (2**40,), False, 0),)), payload, 0)],
        "shape 2**40, small buffer": [env(meta((("torch.float32", (2**40,), False, 0),)), payload, 1),
                                      buf],
        "shape 2**62 x 2**62 x 0": [env(meta((("torch.float32", (2**62, 2**62, 0), False, 0),)),
                                        payload, 0)],
        "100 dims": [env(meta((("torch.float32", (0,) * 100, False, 0),)), payload, 0)],
        "negative shape": [env(meta((("torch.float32", (-4,), False, 0),)), payload, 1), buf],
        "unknown dtype": [env(meta((("torch.evil", (4,), False, 0),)), payload, 1), buf],
        "int requires grad": [env(meta((("torch.int32", (4,), True, 0),)), payload, 1), buf],
        "bad spec kind": [env(meta((("torch.float32", (4,), False, 9),)), payload, 1), buf],
        "payload declares 2**62 bytes": [env(good_meta, b"\x80\x05\x8e" + struct.pack("<Q", 2**62),
                                             1), buf],
        "garbage payload": [env(good_meta, os.urandom(200), 1), buf],
        "bad tensor reference": [env(good_meta, _pickle_with_ref((torch.numel, ("T",), {})), 1),
                                 buf],
    }.items():
        cases[name] = (frames, True)
    return cases


def _authenticated_malformed(rank, world_size):
    import distgrad.rpc as rpc
    from distgrad.errors import DistgradError, RPCTimeoutError
    from distgrad.rpc.agent import _Pending
    from distgrad.wire.messages import HEADER, MAGIC, VERSION, Kind
    if rank != 0:
        return None
    agent = rpc.api.current_agent()
    pid1 = rpc.rpc_sync("worker1", _pid)
    rpc.rpc_sync("worker1", _alive, args=(torch.ones(1000),))
    before = _rss_mib(pid1)
    results = {}
    for name, (frames, replies) in _bad_frames(0).items():
        p = _Pending(1, name, 10.0, False, None)
        rid = next(agent._rids)
        if replies:  # give the message a request id we wait on
            _, _, kind, nbuf, _, meta_len = HEADER.unpack_from(frames[0])
            frames = [HEADER.pack(MAGIC, VERSION, kind, nbuf, rid, meta_len)
                      + frames[0][HEADER.size:], *frames[1:]]
            agent.pending[rid] = p
            p.timer = agent.transport.call_later(10.0, lambda rid=rid: agent._expire(rid))
        agent.transport.send(1, frames)
        if not replies:
            continue
        try:
            p.future.wait()
            results[name] = "no error"
        except RPCTimeoutError:
            results[name] = "timeout"
        except DistgradError as e:
            results[name] = type(e).__name__
    # one-way and reply-kind garbage: dropped without a word
    for kind, rid in ((Kind.CONTROL, 0), (Kind.REPLY, 12345), (Kind.ERROR, 12345)):
        agent.transport.send(1, [HEADER.pack(MAGIC, VERSION, int(kind), 0, rid, 1) + b"xy"])
    assert rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)).tolist() == [2.0, 2.0]
    assert rpc.rpc_sync("worker1", _ping_all, args=(world_size, 256 << 10)) is True
    after = _rss_mib(pid1)
    assert after - before < RSS_GROWTH_MIB, (before, after)
    return results


def _hostile_then_malformed(rank, world_size, marker):
    _hostile(rank, world_size, 256 << 10, 2 << 20, marker)
    return _authenticated_malformed(rank, world_size)


def test_hostile_small_max_message_size_and_authenticated_malformed(tmp_path):
    # 1 MiB per frame, and refused clients that send 2 MiB after their handshake:
    # workers keep serving; then the authenticated-peer cases (one cluster for
    # both: start-up and shutdown dominate the cost)
    marker = str(tmp_path / "pwned")
    results = run_workers(_hostile_then_malformed, world_size=2, timeout=200,
                          options={"max_message_size": 1 << 20}, args=(marker,))[0]
    assert not os.path.exists(marker)
    serialization = {"garbage payload", "payload declares 2**62 bytes"}
    for name, got in results.items():
        want = "SerializationError" if name in serialization else "ProtocolError"
        assert got == want, f"{name}: got {got}, expected {want}; all: {results}"
