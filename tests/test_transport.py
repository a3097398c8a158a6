"""The socket transport on its own: two transports in one process.

Covers small and large messages, per-peer ordering, the same-host
shared-memory path for large frames (segments returned, reused, bounded, and
no files left behind), Unix sockets between same-host peers and TCP otherwise,
big messages both ways while both pools are saturated (no deadlock), the
framing of :mod:`distgrad.transport.framing` at every byte boundary and its
bounds, and a caller reading its own reply while requests keep being served.
"""
import glob
import mmap
import os
import select
import socket
import struct
import threading
import time

import numpy as np
import pytest
from mp_utils import SLOW

from distgrad.transport import framing, shm
from distgrad.transport.socket_transport import SocketTransport

pytestmark = pytest.mark.timeout(240)


class _Collect:
    """Keeps every message; ``on_message`` returns no work."""

    def __init__(self):
        self.messages = []
        self.lost = []
        self.cond = threading.Condition()

    def on_message(self, peer, frames):
        with self.cond:
            self.messages.append((peer, frames))
            self.cond.notify_all()
        return None

    def on_peer_lost(self, peer, reason, graceful):
        with self.cond:
            self.lost.append((peer, reason, graceful))
            self.cond.notify_all()

    def wait_for(self, n, timeout=30):
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.messages) >= n, timeout), \
                f"got {len(self.messages)} of {n} messages"
            return list(self.messages)


def _start_both(a, b, ha, hb, addr_a, addr_b, timeout=90):
    """start() blocks until both sides are connected: run both at once."""
    errors = []

    def go(t, h, peers):
        try:
            t.start(h, peers)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
    threads = [threading.Thread(target=go, args=(a, ha, {1: addr_b}), daemon=True),
               threading.Thread(target=go, args=(b, hb, {0: addr_a}), daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "start() did not return"
    if errors:
        raise errors[0]


def _pair(threshold, same_host=True, handlers=None, **kwargs):
    a = SocketTransport(0, shm_threshold=threshold, **kwargs)
    b = SocketTransport(1, shm_threshold=threshold, **kwargs)
    if not same_host:  # before listen(): the address carries the host tag
        b.host_id = b.host_id + "-elsewhere" if b.host_id else ""
    addr_a, addr_b = a.listen("127.0.0.1"), b.listen("127.0.0.1")
    ha, hb = handlers or (_Collect(), _Collect())
    try:
        _start_both(a, b, ha, hb, addr_a, addr_b)
    except BaseException:
        a.close(0)
        b.close(0)
        raise
    return a, b, ha, hb


def _my_shm_files():
    return glob.glob(os.path.join(shm.SHM_DIR, f"distgrad-{os.getpid()}-*"))


def _in_shm(frame):
    """Whether a received frame is a view of a shared-memory mapping."""
    return (isinstance(frame, memoryview) and isinstance(frame.obj, np.ndarray)
            and isinstance(frame.obj.base, memoryview) and isinstance(frame.obj.base.obj, mmap.mmap))


needs_shm = pytest.mark.skipif(not shm.host_id(), reason="no writable /dev/shm")


@pytest.mark.parametrize("threshold", [0, 1024])
def test_small_and_large_messages_in_order(threshold):
    a, b, ha, hb = _pair(threshold)
    try:
        rng = np.random.default_rng(0)
        sent = []
        for i in range(60):
            size = [0, 1, 100, 5000, 1 << 20][i % 5]
            frames = [b"head%d" % i, bytes([i]) * 3, rng.integers(0, 255, size, dtype=np.uint8)]
            sent.append(frames)
            a.send(1, frames)
        got = hb.wait_for(len(sent))
        assert len(got) == len(sent)
        assert [p for p, _ in got] == [0] * len(sent)
        for (_, frames), want in zip(got, sent):  # same order, same bytes
            assert [bytes(f) for f in frames] == [bytes(memoryview(w)) for w in want]
        # and the other way round
        b.send(0, [b"back", np.arange(300_000, dtype=np.uint8)])
        (_, frames), = ha.wait_for(1)
        assert bytes(frames[1]) == np.arange(300_000, dtype=np.uint8).tobytes()
        assert ha.lost == [] and hb.lost == []
    finally:
        a.close(0)
        b.close(0)
    assert _my_shm_files() == []


def _wait(cond, timeout=10):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@needs_shm
def test_shm_path_is_used_on_same_host_and_cleans_up():
    a, b, ha, hb = _pair(threshold=4096)
    try:
        assert a.uses_shm(1) and b.uses_shm(0)
        payload = np.arange(1 << 20, dtype=np.uint8)
        a.send(1, [b"h", b"small", payload])
        (_, frames), = hb.wait_for(1)
        assert bytes(frames[1]) == b"small"
        # the large frame is a writable view of a mapping, not a copy through the socket
        big = frames[2]
        assert _in_shm(big) and not big.readonly and big.nbytes == payload.nbytes
        assert bytes(big) == payload.tobytes()
        # the sender may reuse its buffer at once: the segment holds a copy
        payload[:] = 0
        assert big[5] == 5
        # sent bytes were counted once (the frame's, not the descriptor's), received ones too
        assert a.stats[1][0] == 1 and b.stats[0][2] == 1
        assert a.stats[1][1] == b.stats[0][3] == 1 + 5 + (1 << 20)
    finally:
        a.close(0)
        b.close(0)
    assert _my_shm_files() == []


@needs_shm
def test_shm_segments_are_returned_and_reused():
    a, b, ha, hb = _pair(threshold=4096)
    try:
        w = a._shm_writer
        one = np.full(300_000, 1, np.uint8)
        a.send(1, [b"h", one])
        a.send(1, [b"h", one * 2])
        got = hb.wait_for(2)
        # both in flight at once: two segments, the second frame did not overwrite the first
        assert w.created == 2
        firsts = [bytes(frames[1][:1]) for _, frames in got]
        assert firsts == [b"\x01", b"\x02"]
        hb.messages.clear()
        del got
        # the receiver dropped its views: both segments come back and are reused
        _wait(lambda: w.free_segments() == 2)
        for i in range(10):
            a.send(1, [b"h", np.full(300_000 + i, i, np.uint8)])  # same size class
            (_, frames), = hb.wait_for(1)
            seen = (frames[1].nbytes, bytes(frames[1][-2:]))  # (asserts would keep views alive)
            hb.messages.clear()
            del frames
            assert seen == (300_000 + i, bytes([i, i]))
            _wait(lambda: w.free_segments() == 2)
        assert w.created == 2
        assert w.pooled()[0] == 2 and len(_my_shm_files()) == 2
    finally:
        a.close(0)
        b.close(0)
    assert _my_shm_files() == []


@needs_shm
def test_shm_pool_bound_unlinks_and_tells_the_receiver():
    a, b, ha, hb = _pair(threshold=4096)
    try:
        a._shm_writer.pool_bytes = 2 << 20  # keeps one free 2 MiB segment at most
        a.send(1, [b"h", np.ones(1 << 20, np.uint8)])
        a.send(1, [b"h", np.ones(1 << 20, np.uint8)])
        got = hb.wait_for(2)
        assert b._shm_reader.mapped() == 2 and len(_my_shm_files()) == 2
        hb.messages.clear()
        del got
        _wait(lambda: len(_my_shm_files()) == 1)   # one over the bound: unlinked
        _wait(lambda: b._shm_reader.mapped() == 1)  # and the receiver forgot it
        # idle segments go too
        a._shm_writer.idle_s = 0.0
        _wait(lambda: len(_my_shm_files()) == 0 and b._shm_reader.mapped() == 0)
    finally:
        a.close(0)
        b.close(0)


@needs_shm
def test_segments_held_by_a_lost_peer_are_unlinked():
    a, b, ha, hb = _pair(threshold=4096)
    try:
        a.send(1, [b"h", np.ones(1 << 20, np.uint8)])
        (_, frames), = hb.wait_for(1)  # b holds the view
        assert len(_my_shm_files()) == 1
        a.call_soon(lambda: a._lose(1, "test", graceful=False))
        _wait(lambda: len(_my_shm_files()) == 0)
        assert bytes(frames[1][:2]) == b"\x01\x01"  # the receiver's mapping stays valid
        # and b sees its connection to a closed: a lost peer, reported once
        with hb.cond:
            assert hb.cond.wait_for(lambda: hb.lost, 10)
        assert [(p, g) for p, _, g in hb.lost] == [(0, False)]
    finally:
        a.close(0)
        b.close(0)


@needs_shm
def test_unreceived_shm_files_removed_at_close():
    w = shm.ShmWriter(rank=7)
    frames = w.pack([b"h", np.ones(10_000, np.uint8)], threshold=1000, peer=1)
    assert frames is not None and frames[0].startswith(shm.MARK) and frames[2] == b""
    assert len(glob.glob(os.path.join(shm.SHM_DIR, w.prefix + "*"))) == 1
    w.cleanup()
    assert glob.glob(os.path.join(shm.SHM_DIR, w.prefix + "*")) == []


def test_tcp_fallback_across_hosts():
    a, b, ha, hb = _pair(threshold=1024, same_host=False)
    try:
        assert not a.uses_shm(1) and not b.uses_shm(0)
        payload = np.arange(200_000, dtype=np.uint8)
        a.send(1, [b"h", payload])
        (_, frames), = hb.wait_for(1)
        assert bytes(frames[1]) == payload.tobytes()
        assert not _in_shm(frames[1])  # read from the socket into its own buffer
        b.send(0, [b"h", payload[::-1].copy()])
        (_, frames), = ha.wait_for(1)
        assert bytes(frames[1]) == payload[::-1].tobytes() and not _in_shm(frames[1])
        assert _my_shm_files() == []
    finally:
        a.close(0)
        b.close(0)


@pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="no Unix domain sockets")
def test_unix_sockets_on_one_host_tcp_across_hosts():
    from distgrad.transport.socket_transport import host_key
    if not host_key():
        pytest.skip("no host key (no /proc): every peer uses TCP")
    a, b, _, _ = _pair(threshold=0)
    try:
        assert a._conns[1].sock.family == socket.AF_UNIX
        assert b._conns[0].sock.family == socket.AF_UNIX
    finally:
        a.close(0)
        b.close(0)
    a, b, ha, hb = _pair(threshold=0, same_host=False)
    try:
        assert a._conns[1].sock.family == socket.AF_INET
        assert b._conns[0].sock.family == socket.AF_INET
        assert a._conns[1].sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        a.send(1, [b"over tcp"])
        assert bytes(hb.wait_for(1)[0][1][0]) == b"over tcp"
    finally:
        a.close(0)
        b.close(0)


def test_intruders_during_start_up_do_not_stop_it():
    # Before the real peer connects, outsiders reach the listening socket: garbage, a
    # hello with other settings (no secret), a hello with a forged proof. Each is
    # refused; start() still completes with the real peer, and a message goes through.
    import raw_peer as rp
    a, b = SocketTransport(0, secret=b"k"), SocketTransport(1, secret=b"k")
    addr_a, addr_b = a.listen("127.0.0.1"), b.listen("127.0.0.1")
    tcp = addr_b.split("#")[0][len("tcp://"):].rsplit(":", 1)
    ha, hb = _Collect(), _Collect()
    done, errors = threading.Event(), []

    def start_b():
        try:
            b.start(hb, {0: addr_a})
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        done.set()
    th = threading.Thread(target=start_b, daemon=True)
    th.start()
    try:
        for data in (os.urandom(4096), rp.hello(0, 1, 0), rp.hello(0, 1, rp.F_SECRET) + os.urandom(32)):
            s = socket.create_connection((tcp[0], int(tcp[1])), timeout=10)
            rp.send_quietly(s, data)
            assert rp.closed_by_peer(s, 10)  # refused
            s.close()
        assert not done.is_set() and not errors, errors  # b still waits for worker 0
        a.start(ha, {1: addr_b})
        th.join(60)
        assert done.is_set() and not errors, errors
        a.send(1, [b"after the intruders"])
        assert bytes(hb.wait_for(1)[0][1][0]) == b"after the intruders"
    finally:
        a.close(0)
        b.close(0)


def test_shm_disabled_by_threshold():
    a, b, ha, hb = _pair(threshold=0)
    try:
        assert not a.uses_shm(1)
        c = SocketTransport(2, shm_threshold=0)
        assert "#shm=" not in c.listen("127.0.0.1")
        c.close(0)
        a.send(1, [b"h", np.ones(1 << 20, np.uint8)])
        (_, frames), = hb.wait_for(1)
        assert not _in_shm(frames[1]) and _my_shm_files() == []
    finally:
        a.close(0)
        b.close(0)


def test_calls_from_many_threads_keep_per_thread_order():
    a, b, ha, hb = _pair(threshold=0)
    try:
        def run(t):
            for i in range(200):
                a.send(1, [b"%d" % t, b"%d" % i])
        threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got = hb.wait_for(800)
        for t in range(4):
            seq = [int(bytes(f[1])) for _, f in got if bytes(f[0]) == b"%d" % t]
            assert seq == list(range(200))
    finally:
        a.close(0)
        b.close(0)


class _Saturating:
    """Small messages return work that blocks until ``gate`` opens (the pool fills
    up); big ones are checked and counted, not kept."""

    def __init__(self, gate):
        self.gate = gate
        self.blocked = 0
        self.big = []
        self.lost = []
        self.cond = threading.Condition()

    def on_message(self, peer, frames):
        if len(frames) == 1:
            return (self._block, ())
        f = frames[1]
        with self.cond:
            self.big.append((bytes(frames[0]), memoryview(f).nbytes,
                             bytes(memoryview(f)[:4]), bytes(memoryview(f)[-4:])))
            self.cond.notify_all()
        return None

    def _block(self):
        with self.cond:
            self.blocked += 1
            self.cond.notify_all()
        self.gate.wait(120)

    def on_peer_lost(self, peer, reason, graceful):
        self.lost.append((peer, reason))


def test_big_messages_both_ways_while_both_pools_are_saturated():
    # Every pool thread of both transports is busy (blocked in work), and several
    # threads of each send 64 MB messages to the other at once, larger than any
    # socket buffer. The leader keeps reading while the pool is full, so every
    # send completes and every message arrives before any work finishes.
    gate = threading.Event()
    ha, hb = _Saturating(gate), _Saturating(gate)
    a, b, _, _ = _pair(threshold=0, handlers=(ha, hb), num_threads=2, heartbeat_interval=0.05,
                       heartbeat_deadline=30)
    size, nthreads, each = 64 << 20, 3, 2
    payload = np.empty(size, np.uint8)
    payload[:4] = (1, 2, 3, 4)
    payload[-4:] = (5, 6, 7, 8)
    try:
        for _ in range(4):  # more than the pool's threads (2 workers + the leader)
            a.send(1, [b"block"])
            b.send(0, [b"block"])
        for h in (ha, hb):
            with h.cond:
                assert h.cond.wait_for(lambda h=h: h.blocked >= 2, 30)
        errors = []

        def run(t, peer, tag):
            try:
                for i in range(each):
                    t.send(peer, [b"%s%d" % (tag, i), payload])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        threads = [threading.Thread(target=run, args=(t, peer, b"%d-%d-" % (peer, k)), daemon=True)
                   for k in range(nthreads) for t, peer in ((a, 1), (b, 0))]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        stuck = sum(t.is_alive() for t in threads)
        assert not stuck, (f"{stuck} senders deadlocked after {time.monotonic() - t0:.0f} s; "
                           f"received {len(ha.big)} and {len(hb.big)} of {nthreads * each} each")
        assert not errors, errors
        for h in (ha, hb):
            with h.cond:
                assert h.cond.wait_for(lambda h=h: len(h.big) == nthreads * each, 60)
        for h, peer in ((ha, 0), (hb, 1)):
            assert {(n, head, tail) for _, n, head, tail in h.big} == \
                {(size, b"\x01\x02\x03\x04", b"\x05\x06\x07\x08")}
            for k in range(nthreads):  # each thread's messages in its order
                mine = [tag for tag, *_ in h.big if tag.startswith(b"%d-%d-" % (peer, k))]
                assert mine == [b"%d-%d-%d" % (peer, k, i) for i in range(each)]
        assert ha.blocked == hb.blocked == 2  # nothing finished meanwhile: the pools stayed full
        assert ha.lost == [] and hb.lost == []
    finally:
        gate.set()
        a.close(0)
        b.close(0)


# -- framing -------------------------------------------------------------------
def _stream(messages):
    return b"".join(framing.pack_header(m) + b"".join(bytes(f) for f in m) for m in messages)


def _reader_pair():
    w, r = socket.socketpair()
    r.setblocking(False)
    return w, r


def _as_bytes(msgs):
    return [[bytes(f) for f in m] for m in msgs]


_MESSAGES = [
    [b"envelope", b"tensor bytes"],
    [b""],                                    # one empty frame
    [b"", b"", b"x", b""],                    # empty frames around a byte
    [bytes(range(256)) * 20],                 # 5 KiB
    [b"h", os.urandom(40_000), b"t"],         # a frame read into its own buffer
    [b"%d" % i for i in range(300)],          # many frames in one message
]


def test_framing_split_at_every_byte():
    data = _stream(_MESSAGES)
    w, r = _reader_pair()
    try:
        reader = framing.FrameReader(1 << 20)
        ends = set(np.cumsum([len(_stream([m])) for m in _MESSAGES]).tolist())
        got = []
        for i in range(len(data)):  # one byte at a time: every boundary is a split
            w.sendall(data[i:i + 1])
            got += reader.read(r)
            # a message is complete exactly at its last byte, not before
            assert len(got) == sum(e <= i + 1 for e in ends)
            assert reader.pending() == (i + 1 not in ends)
        assert _as_bytes(got) == _MESSAGES
        # the large frame lands in its own, writable buffer (tensors are built on it)
        big = got[4][1]
        assert len(big) == 40_000 and memoryview(big).readonly is False
    finally:
        w.close()
        r.close()


def test_framing_every_two_part_split():
    msgs = [[b"ab", b""], [b"cde" * 30], [b"", b"f"]]
    data = _stream(msgs)
    for cut in range(len(data) + 1):
        w, r = _reader_pair()
        try:
            reader = framing.FrameReader(1 << 20)
            w.sendall(data[:cut])
            got = reader.read(r)
            w.sendall(data[cut:])
            got += reader.read(r)
            assert _as_bytes(got) == msgs, cut
            assert not reader.pending()
        finally:
            w.close()
            r.close()


def test_framing_many_messages_and_frames_through_send_frames():
    w, r = _reader_pair()
    w.setblocking(False)
    try:
        reader = framing.FrameReader(1 << 20)
        sent = [[b"%d" % i, bytes(i % 7), os.urandom(i * 37 % 70_000)] for i in range(500)]
        sent.append([b"%d" % i for i in range(20_000)])  # many frames: several sendmsg calls
        got = []
        rest = [framing.coalesce(m) for m in sent]
        while rest or len(got) < len(sent):  # send and read in turn (one thread, small buffers)
            if rest:
                rest[0] = framing.send_some(w, rest[0])
                if not rest[0]:
                    rest.pop(0)
            got += reader.read(r)
        assert _as_bytes(got) == [[bytes(f) for f in m] for m in sent]
        assert not reader.pending()
    finally:
        w.close()
        r.close()


def test_framing_bounds_raise_before_allocating(monkeypatch):
    sizes = []
    real = framing._alloc

    def spy(n):
        sizes.append(n)
        return real(n)
    monkeypatch.setattr(framing, "_alloc", spy)

    def fails(data, max_frame=1 << 20):
        w, r = _reader_pair()
        try:
            w.sendall(data)
            with pytest.raises(framing.FrameError):
                framing.FrameReader(max_frame).read(r)
        finally:
            w.close()
            r.close()
    # a frame over the bound, declared alone or among small ones: refused from the header
    fails(struct.pack("!IQ", 1, (1 << 20) + 1))
    fails(struct.pack("!IQ", 1, 2 ** 62))
    fails(struct.pack("!I3Q", 3, 1, 2 ** 63, 1) + b"x")
    # frame counts: zero, one over MAX_FRAMES, absurd (no header buffer is made for them)
    fails(struct.pack("!I", 0) + bytes(8))
    fails(struct.pack("!I", framing.MAX_FRAMES + 1) + bytes(64))
    fails(struct.pack("!I", 2 ** 32 - 1) + bytes(64))
    assert sizes == []  # nothing was allocated for any of them
    # at the bound itself: accepted
    w, r = _reader_pair()
    try:
        reader = framing.FrameReader(64)
        w.sendall(_stream([[bytes(64)]]))
        assert _as_bytes(reader.read(r)) == [[bytes(64)]]
    finally:
        w.close()
        r.close()


def test_framing_largest_frame_count_round_trips():
    # MAX_FRAMES is what the reader accepts; a header of that many frames must fit
    n = framing.MAX_FRAMES
    w, r = _reader_pair()
    w.setblocking(False)
    try:
        reader = framing.FrameReader(1 << 20)
        rest = framing.coalesce([b"a"] * n)
        got = []
        while rest or not got:
            if rest:
                rest = framing.send_some(w, rest)
            got += reader.read(r)
        assert len(got) == 1 and len(got[0]) == n
    finally:
        w.close()
        r.close()


def test_framing_closed_stream_mid_message():
    w, r = _reader_pair()
    try:
        reader = framing.FrameReader(1 << 20)
        w.sendall(_stream([[b"whole"]]) + _stream([[b"torn message"]])[:-3])
        assert _as_bytes(reader.read(r)) == [[b"whole"]]
        assert reader.pending()
        w.close()
        with pytest.raises(EOFError):
            reader.read(r)
    finally:
        r.close()


# -- processes -------------------------------------------------------------------
def _rpc_big(rank, world_size):
    import torch

    import distgrad.rpc as rpc
    if rank != 0:
        return None
    x = torch.arange(1 << 19, dtype=torch.float32)  # 2 MB
    y = rpc.rpc_sync("worker1", torch.mul, args=(x, 2))
    z = rpc.rpc_sync("worker1", torch.clone, args=(y,))
    y.add_(1)  # a received tensor is writable and private
    return [bool(torch.equal(z, x * 2)), bool(torch.equal(y, x * 2 + 1)),
            rpc.rpc_sync("worker1", torch.sum, args=(torch.ones(3),)).item()]


@needs_shm
def test_rpc_over_shm_between_processes(monkeypatch):
    from mp_utils import run_workers
    monkeypatch.setenv("DISTGRAD_SHM_THRESHOLD", "65536")
    assert run_workers(_rpc_big, world_size=2, timeout=90)[0] == [True, True, 3.0]


_SLEEPING = threading.Event()
_OWN_SLEEP = 3.0 * SLOW   # s: worker0's call, during which worker1's request is served


def _sleeper(seconds):
    _SLEEPING.set()
    time.sleep(seconds)
    return "slept"


def _served_while_reading():
    """Runs on worker0 while its main thread waits for worker1's reply: whether
    that thread owns (reads) the connection to worker1."""
    import distgrad.rpc as rpc
    return bool(rpc.api.current_agent().transport._conns[1].owned)


def _own_reply(rank, world_size):
    import distgrad.rpc as rpc
    if rank == 0:
        t0 = time.monotonic()
        out = rpc.rpc_sync("worker1", _sleeper, args=(_OWN_SLEEP,), timeout=60)
        return out, time.monotonic() - t0
    assert _SLEEPING.wait(60), "worker0's call never arrived"
    t0 = time.monotonic()
    owned = rpc.rpc_sync("worker0", _served_while_reading, timeout=30)
    served_in = time.monotonic() - t0
    return owned, served_in


def test_caller_reads_its_own_reply_and_requests_are_still_served():
    # worker0's main thread waits in rpc_sync for worker1 (which sleeps 3 s x SLOW), reading
    # the connection itself; worker1 calls worker0 meanwhile: the request arrives on
    # that very connection and is served at once; both calls finish.
    from mp_utils import run_workers
    (out, took), (owned, served_in) = run_workers(_own_reply, world_size=2, timeout=120)
    assert out == "slept" and took >= _OWN_SLEEP
    # not after worker0's call ended (as much slack as that allows)
    assert served_in < _OWN_SLEEP, served_in
    assert owned is True  # read by the caller's read_until, not the leader


@needs_shm
def test_no_room_in_shm_falls_back_to_tcp(monkeypatch, caplog):
    a, b, ha, hb = _pair(threshold=4096)
    try:
        def full(fd, offset, size):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(os, "posix_fallocate", full)
        payload = np.arange(1 << 20, dtype=np.uint8)
        a.send(1, [b"h", payload])
        (_, frames), = hb.wait_for(1)
        assert bytes(frames[1]) == payload.tobytes()
        assert not _in_shm(frames[1])  # came over the socket
        assert a._shm_writer.failures == 1 and _my_shm_files() == []
        assert "over TCP" in caplog.text
    finally:
        a.close(0)
        b.close(0)


def test_silent_peer_is_lost_though_nobody_reads_its_connection():
    # The heartbeat check reads a silent peer's connection before calling it lost; an
    # empty read is no sign of life (it once was: a silent peer that nobody waited on,
    # e.g. a host gone without a FIN, was never lost)
    a, b, ha, _ = _pair(threshold=0, heartbeat_interval=0.05, heartbeat_deadline=0.5)
    try:
        b._heartbeat = lambda now: None  # b goes silent: no heartbeats, no checks
        start = time.monotonic()
        with ha.cond:
            assert ha.cond.wait_for(lambda: ha.lost, 10 * SLOW), "the silent peer was never lost"
        assert ha.lost[0][0] == 1 and "no heartbeat" in ha.lost[0][1], ha.lost
        assert time.monotonic() - start < 5 * SLOW  # heartbeat deadline 0.5 s: a hang guard
    finally:
        a.close(0)
        b.close(0)


def test_unreachable_hint_names_a_loopback_address_across_hosts():
    # A peer on another host (or network namespace) cannot reach 127.0.0.1: the
    # connect timeout's error says so and what to set
    from distgrad.transport.socket_transport import host_key
    if not host_key():
        pytest.skip("no host key (no /proc)")
    t = SocketTransport(0)
    try:
        t.listen("127.0.0.1")
        t._addresses = {1: "tcp://10.0.0.2:5000#host=elsewhere", 2: "tcp://10.0.0.3:5000",
                        3: f"tcp://127.0.0.1:5000#host={t.host_id}"}
        hint = t._unreachable_hint(1)
        assert "worker 0 listens on the loopback address 127.0.0.1" in hint
        assert "DISTGRAD_SOCKET_IFNAME" in hint
        assert t._unreachable_hint(2) == ""  # no host tag: unknown
        assert t._unreachable_hint(3) == ""  # same host: loopback is fine
    finally:
        t.close(0)


class _Clock:
    """``time`` for the transport's reading loop, with a monotonic clock the test moves."""

    def __init__(self):
        self.now = time.monotonic()

    def monotonic(self):
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


def _until(pred, what, limit=10 * SLOW):
    end = time.monotonic() + limit
    while not pred():
        assert time.monotonic() < end, what
        time.sleep(0.001)


def test_liveness_credit_of_a_long_message_is_withdrawn_when_it_fails_authentication(monkeypatch):
    # Parts of a long message on their way keep its sender alive (its heartbeats queue
    # behind it), on credit: a message that then fails its MAC withdraws the credit, so
    # bytes nobody authenticated never stand for a sign of life (issue 30), and the
    # connection closes at once (issue 35: the stream is not what the peer sent). Here
    # b goes silent and its connection carries, part by part for 1.4 s of a's time, a
    # forged message. a's clock is the test's: moved 0.1 s a part, a's liveness check
    # seen to run at each step (a thread sending parts on the real clock, preempted past
    # the 0.5 s deadline, had b rightly called silent)
    from distgrad.transport import reading
    from distgrad.transport.auth import AUTH_FRAME_BYTES
    a, b, ha, _ = _pair(threshold=0, heartbeat_interval=0.05, heartbeat_deadline=0.5,
                        secret=b"s" * 32)
    conn = b._conns[0]
    held = False
    try:
        clock = _Clock()
        monkeypatch.setattr(reading, "time", clock)
        beats = []
        heartbeat = a._heartbeat
        a._heartbeat = lambda now: (heartbeat(now), beats.append(now))

        def tick():   # a's clock moves half a heartbeat interval, and a checks liveness then
            clock.now += a.heartbeat_interval / 2
            _until(lambda: beats and beats[-1] >= clock.now, "a's heartbeat did not run")
        b._heartbeat = lambda now: None  # b sends nothing of its own from now on
        # the socket is the test's: a heartbeat b had on its way is out, none can follow
        held = conn.wlock.acquire(timeout=10)
        assert held and not conn.deferred and not conn.outq
        peer = a._conns[1]   # a has read what b sent before (a heartbeat, in a read of its own)
        _until(lambda: not select.select([peer.sock], [], [], 0)[0] and not peer.rlock.locked(),
               "a did not read what b sent before")
        base = peer.reader.received
        frames = [b"\x00" * AUTH_FRAME_BYTES, b"x" * (64 << 10)]
        raw = b"".join(bytes(v) for v in framing._views(frames))
        sock = conn.sock
        sock.setblocking(True)
        parts = 15
        step = len(raw) // parts
        for i in range(parts - 1):           # 1.4 s of parts: a keeps b alive meanwhile
            sock.sendall(raw[i * step:(i + 1) * step])
            _until(lambda i=i: peer.reader.received == base + (i + 1) * step and not peer.rlock.locked(),
                   "a did not read the part")   # (read at this time: nothing moved the clock)
            for _ in range(4):
                tick()
            assert not ha.lost, f"lost while the message was on its way: {ha.lost}"
        assert len(beats) >= 4 * (parts - 1) and clock.now - beats[0] > 2 * a.heartbeat_deadline
        sock.sendall(raw[(parts - 1) * step:])   # the message ends: its MAC fails
        with ha.cond:
            assert ha.cond.wait_for(lambda: ha.lost, 10), "the peer was never lost"
        assert ha.lost[0][0] == 1 and "failed authentication" in ha.lost[0][1], ha.lost
        assert 1 not in a._last_partial, "the credit stood"
    finally:
        if held:
            conn.wlock.release()
        a.close(0)
        b.close(0)
