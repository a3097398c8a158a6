"""The zmq transport on its own: two transports in one process over 127.0.0.1.

Covers small and large messages, per-peer ordering, the same-host
shared-memory path for large frames (segments returned, reused, bounded, and
no files left behind),
and the TCP fallback when the peers are not on the same host.
"""
import glob
import os
import threading
import time

import numpy as np
import pytest

from distgrad.transport import shm
from distgrad.transport.zmq_transport import ZmqTransport


class _Collect:
    def __init__(self):
        self.messages = []
        self.cond = threading.Condition()

    def on_message(self, peer, frames):
        with self.cond:
            self.messages.append((peer, frames))
            self.cond.notify_all()

    def on_peer_lost(self, peer, reason, graceful):
        pass

    def wait_for(self, n, timeout=20):
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.messages) >= n, timeout), \
                f"got {len(self.messages)} of {n} messages"
            return list(self.messages)


def _pair(threshold, same_host=True):
    a, b = ZmqTransport(0, shm_threshold=threshold), ZmqTransport(1, shm_threshold=threshold)
    if not same_host:
        b.host_id = b.host_id + "-elsewhere" if b.host_id else ""
    addr_a, addr_b = a.listen("127.0.0.1"), b.listen("127.0.0.1")
    ha, hb = _Collect(), _Collect()
    a.start(ha, {1: addr_b})
    b.start(hb, {0: addr_a})
    return a, b, ha, hb


def _my_shm_files():
    return glob.glob(os.path.join(shm.SHM_DIR, f"distgrad-{os.getpid()}-*"))


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
        assert [p for p, _ in got] == [0] * len(sent)
        for (_, frames), want in zip(got, sent):  # same order, same bytes
            assert [bytes(f) for f in frames] == [bytes(memoryview(w)) for w in want]
        # and the other way round
        b.send(0, [b"back", np.arange(300_000, dtype=np.uint8)])
        (_, frames), = ha.wait_for(1)
        assert bytes(frames[1]) == np.arange(300_000, dtype=np.uint8).tobytes()
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
        assert isinstance(big, memoryview) and not big.readonly and big.nbytes == payload.nbytes
        assert isinstance(big.obj.base.obj, __import__("mmap").mmap)
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
        assert not isinstance(frames[1].obj, __import__("mmap").mmap)
    finally:
        a.close(0)
        b.close(0)


def test_shm_disabled_by_threshold():
    a, b, ha, hb = _pair(threshold=0)
    try:
        assert not a.uses_shm(1)
        c = ZmqTransport(2, shm_threshold=0)
        assert "#shm=" not in c.listen("127.0.0.1")
        c.close(0)
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
    assert run_workers(_rpc_big, world_size=2, timeout=60)[0] == [True, True, 3.0]


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
        assert not isinstance(frames[1].obj, np.ndarray)  # came over TCP
        assert a._shm_writer.failures == 1 and _my_shm_files() == []
        assert "over TCP" in caplog.text
    finally:
        a.close(0)
        b.close(0)
