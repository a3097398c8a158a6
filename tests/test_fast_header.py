"""The fast path: the fixed binary header (wire/fast_header.py), the agent's
choice of layout (rpc/fast_path.py), batched sends and batched serving.

Checked: a fast envelope decodes to the very message (and objects) the general
one does; every field of its header and tensor table is validated and a
corrupted one raises ProtocolError before anything is unpickled; messages that
need meta (an autograd context, RRef bookkeeping, pins, remote()) and tensors
the fast table cannot describe go the general way; several messages queued for
one peer leave in one sendmsg; several work items from one read are all run by
the thread that read them, with no wake-up.
"""
import struct
import threading
import time
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distgrad.errors import ProtocolError
from distgrad.rpc.fast_path import FastPath
from distgrad.transport import framing
from distgrad.transport.leader import LeaderFollowers
from distgrad.wire import Kind, decode, dumps, encode, encode_fast, loads
from distgrad.wire.fast_header import FAST, FAST_MAGIC, FAST_VERSION, MAX_WHAT
from distgrad.wire.messages import peek_header, request_id
from distgrad.wire.pickler import check_specs

pytestmark = pytest.mark.timeout(240)


def _tensors():
    p = torch.nn.Parameter(torch.randn(3, 2))
    return [torch.ones(16), torch.arange(6, dtype=torch.int64).reshape(2, 3), torch.tensor(3.5),
            torch.empty(0, 4), torch.randn(2, 3, requires_grad=True), p,
            torch.zeros(5, dtype=torch.bool), torch.randint(0, 9, (4,), dtype=torch.uint8),
            torch.randn(4, dtype=torch.float16), torch.ones(70_000)]  # last: zero-copy


def _both(kind, rid, meta, what, obj):
    data, tensors = dumps(obj)
    general = encode(kind, rid, meta, data, tensors)
    fast = encode_fast(kind, rid, what, data, tensors)
    assert fast is not None and bytes(fast[0][:2]) == FAST_MAGIC
    return general, fast


def _same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach(), b.detach())
        assert a.requires_grad == b.requires_grad
        return
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b


@pytest.mark.parametrize("kind", [Kind.CALL, Kind.NOTIFY, Kind.REPLY])
def test_fast_and_general_decode_to_the_same_message(kind):
    ts = _tensors()
    obj = (torch.add, tuple(ts), {"k": ts[0]}) if kind != Kind.REPLY else {"out": ts, "n": 3}
    meta = None if kind == Kind.REPLY else ("torch.add", None, None)
    what = "" if kind == Kind.REPLY else "torch.add"
    general, fast = _both(kind, 41, meta, what, obj)
    g, f = decode(general), decode(fast)
    assert (g.kind, g.rid, g.meta) == (f.kind, f.rid, f.meta) == (kind, 41, meta)
    assert check_specs(g.specs) == f.specs
    assert bytes(g.payload) == bytes(f.payload)
    assert peek_header(general) == peek_header(fast)
    _same(loads(g.payload, g.specs, g.buffers), loads(f.payload, tensors=f.tensors))
    assert request_id(fast) == (41 if kind == Kind.CALL else None)


def test_fast_tensors_are_views_of_the_received_buffers():
    data, tensors = dumps(torch.ones(70_000))
    frames = encode_fast(Kind.REPLY, 1, "", data, tensors)
    received = [bytearray(frames[0]), bytearray(memoryview(frames[1]))]
    t = decode(received).tensors[0]
    assert t.data_ptr() == torch.frombuffer(received[1], dtype=torch.uint8).data_ptr()


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 4).t(),                          # not contiguous
    lambda: torch.randn(3).to_sparse(),                     # sparse
    lambda: torch.randn(3, dtype=torch.complex64),          # dtype outside the table
    lambda: torch.randn(2, dtype=torch.bfloat16),
    lambda: torch.randn(3)._neg_view(),                     # a negative bit
])
def test_tensors_the_table_cannot_describe_go_the_general_way(make):
    data, tensors = dumps(make())
    assert encode_fast(Kind.CALL, 1, "f", data, tensors) is None


def test_too_long_a_name_goes_the_general_way():
    assert encode_fast(Kind.CALL, 1, "x" * (MAX_WHAT + 1), b"", []) is None


# -- every field checked ------------------------------------------------------------
def _fast_frames(shape=(2, 3), dtype=torch.float32, requires_grad=False, what="mod.f", kind=Kind.CALL):
    t = torch.zeros(shape, dtype=dtype, requires_grad=requires_grad)
    data, tensors = dumps((len, (t,), {}))
    return encode_fast(kind, 7, what, data, tensors)


def _patched(frames, offset, fmt, value):
    env = bytearray(frames[0])
    struct.pack_into(fmt, env, offset, value)
    return [env, *frames[1:]]


_TABLE = FAST.size + len(b"mod.f")  # where the first tensor entry starts
CORRUPTIONS = {
    "magic": (0, "!2s", b"DX"),
    "version": (2, "!B", FAST_VERSION + 1),
    "kind remote": (3, "!B", int(Kind.REMOTE)),
    "kind error": (3, "!B", int(Kind.ERROR)),
    "kind control": (3, "!B", int(Kind.CONTROL)),
    "kind unknown": (3, "!B", 99),
    "buffer count high": (4, "!I", 2),
    "buffer count zero": (4, "!I", 0),
    "name too long": (16, "!H", 60000),
    "tensor count high": (18, "!H", 2),
    "tensor count zero": (18, "!H", 0),
    "dtype code": (_TABLE, "!B", 200),
    "flags": (_TABLE + 1, "!B", 4),
    "dims over 64": (_TABLE + 2, "!B", 65),
    "dims more": (_TABLE + 2, "!B", 3),
    "dims fewer": (_TABLE + 2, "!B", 1),
    "a dimension": (_TABLE + 3, "!Q", 3),
    "a huge dimension": (_TABLE + 3, "!Q", 1 << 62),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_every_header_field_is_checked(name):
    offset, fmt, value = CORRUPTIONS[name]
    frames = _patched(_fast_frames(), offset, fmt, value)
    with pytest.raises(ProtocolError):
        decode(frames)
    with pytest.raises(ProtocolError):
        peek_header(frames) if name in ("magic", "version", "kind remote", "kind error",
                                        "kind control", "kind unknown", "buffer count high",
                                        "buffer count zero", "name too long") else decode(frames)


def test_requires_grad_only_on_floating_dtypes():
    frames = _fast_frames(dtype=torch.int64)
    flags_at = _TABLE + 1
    with pytest.raises(ProtocolError, match="cannot require grad"):
        decode(_patched(frames, flags_at, "!B", 1))


def test_name_must_be_utf8_and_replies_name_nothing():
    frames = _fast_frames(what="ab")
    env = bytearray(frames[0])
    env[FAST.size:FAST.size + 2] = b"\xff\xfe"
    with pytest.raises(ProtocolError, match="name"):
        decode([env, *frames[1:]])
    reply = _patched(_fast_frames(what="ab"), 3, "!B", int(Kind.REPLY))
    with pytest.raises(ProtocolError, match="reply"):
        decode(reply)


def test_buffers_are_checked_against_the_table():
    frames = _fast_frames()
    with pytest.raises(ProtocolError):
        decode([frames[0], bytes(len(frames[1]) - 4)])        # short buffer
    with pytest.raises(ProtocolError):
        decode([frames[0]])                                   # missing buffer
    with pytest.raises(ProtocolError):
        decode([frames[0][:FAST.size - 1]])                   # short header
    with pytest.raises(ProtocolError):
        decode([frames[0][:_TABLE + 5], frames[1]])           # table cut short


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_fast_envelopes_raise_protocol_error_or_decode(data):
    frames = _fast_frames(shape=(3,), what="m.f")
    env = bytearray(frames[0])
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(env) - 1))
        env[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(env)))
    try:
        msg = decode([bytes(env[:cut]), *frames[1:]])
    except ProtocolError:
        return
    assert msg.kind in (Kind.CALL, Kind.NOTIFY, Kind.REPLY, Kind.GRADS)  # and its tensors fit their buffers
    for t in msg.tensors:
        assert t.numel() * t.element_size() <= 12


# -- the agent's choice ------------------------------------------------------------
class _Ext:
    def outgoing(self, dest, tensors, ctx):
        return (ctx, None)


class _Stub(FastPath):
    fast = True
    workers = [None, types.SimpleNamespace(id=1, name="worker1")]
    extensions = [_Ext()]

    def __init__(self) -> None:   # no device maps (the agent's, rpc/devices.py)
        self.request_routes, self.reply_routes, self.reverse_device_maps, self.devices = {}, {}, {}, []


@pytest.mark.parametrize("kind,extra,ctx,layout", [
    (Kind.CALL, None, None, b"DF"),
    (Kind.NOTIFY, None, None, b"DF"),
    (Kind.CALL, {"rref": (0, 1)}, None, b"DG"),      # a call on an RRef
    (Kind.CALL, {"pins": [(0, 1)]}, None, b"DG"),    # RRefs going home
    (Kind.REMOTE, {"new": ((0, 1), (0, 2))}, None, b"DG"),
    (Kind.REMOTE, None, None, b"DG"),
    (Kind.CALL, None, 123, b"DG"),                   # inside an autograd context
])
def test_messages_needing_meta_take_the_general_layout(kind, extra, ctx, layout):
    dest = types.SimpleNamespace(id=1, name="worker1")
    frames = _Stub()._request_frames(dest, kind, 5, (len, ([1],), {}), "builtins.len", extra, ctx)
    assert bytes(frames[0][:2]) == layout
    msg = decode(frames)
    assert msg.rid == 5 and msg.kind == kind
    if layout == b"DG":
        assert msg.meta[0] == "builtins.len" and (msg.meta[1], msg.meta[2]) == (
            (ctx, None) if ctx is not None else None, extra)


def test_replies_in_a_context_take_the_general_layout():
    stub = _Stub()
    assert bytes(stub._reply_frames(1, 9, torch.ones(2), None)[0][:2]) == b"DF"
    frames = stub._reply_frames(1, 9, torch.ones(2), 77)
    assert bytes(frames[0][:2]) == b"DG" and decode(frames).meta == (77, None)
    stub.fast = False
    assert bytes(stub._reply_frames(1, 9, torch.ones(2), None)[0][:2]) == b"DG"


# -- many messages, few system calls --------------------------------------------------
def test_messages_queued_for_one_peer_leave_in_one_sendmsg(monkeypatch):
    from test_transport import _pair
    a, b, _, hb = _pair(1 << 30, heartbeat_interval=60.0, heartbeat_deadline=120.0)  # no beats
    calls = []
    orig = framing.send_some

    class Counting:
        def __init__(self, sock):
            self.sock = sock

        def sendmsg(self, views):
            calls.append(b"".join(bytes(v) for v in views))
            return self.sock.sendmsg(views)

        def send(self, view):
            calls.append(bytes(view))
            return self.sock.send(view)

    monkeypatch.setattr(framing, "send_some", lambda sock, views: orig(Counting(sock), views))
    try:
        conn = a._conns[1]
        with conn.wlock:  # another thread holds the write lock: sends only queue
            conn.wowner = threading.get_ident()
            for i in range(10):
                a.send(1, [b"msg %d" % i])
            assert not [c for c in calls if b"msg " in c] and len(conn.deferred) == 10
            conn.wowner = 0
        before = list(a.batches)
        a.send(1, [b"msg 10"])  # the next holder sends all eleven
        ours = [c for c in calls if b"msg " in c]  # (a heartbeat may go on its own)
        assert len(ours) == 1 and all(b"msg %d" % i in ours[0] for i in range(11))
        assert a.batches[1] - before[1] >= 11
        got = hb.wait_for(11)
        assert [bytes(f[0]) for _, f in got[-11:]] == [b"msg %d" % i for i in range(11)]
    finally:
        a.close(0)
        b.close(0)


def test_several_messages_from_one_read_run_on_the_reading_thread_without_wakeups():
    """Steady state: idle threads wait in the poller (a queue here: nothing wakes
    them but a ready socket); the one handed a read of six replies runs all six.
    Requests (work not marked batchable) wake a thread, since one may block."""
    import queue
    ready: queue.SimpleQueue = queue.SimpleQueue()
    ran, woke = [], []

    def lead():
        item = ready.get()
        return item

    pool = LeaderFollowers(lead, 4, name="t", shared=lambda: (woke.append(1), ready.put([])))
    pool.start()
    started = threading.Event()
    ready.put([(started.set, ())])  # the first read: its reader starts a second waiter
    assert started.wait(20)
    end = time.monotonic() + 20
    while pool.readers() < 2 and time.monotonic() < end:
        time.sleep(0.01)
    before = pool.wakes
    def reply(i):
        ran.append((i, threading.get_ident()))
    reply.batchable = True  # as the agent's reply completion is
    ready.put([(reply, (i,)) for i in range(6)])
    while len(ran) < 6 and time.monotonic() < end:
        time.sleep(0.01)
    wakes = (list(woke), pool.wakes - before)  # shutdown() itself wakes the waiters
    for _ in range(8):
        ready.put(None)
    pool.shutdown(wait=True)
    assert [i for i, _ in ran] == list(range(6))
    assert len({t for _, t in ran}) == 1  # the thread that read them ran them all
    assert wakes == ([], 0)


def test_a_batch_with_requests_wakes_a_thread():
    import queue
    ready: queue.SimpleQueue = queue.SimpleQueue()
    release = threading.Event()
    ran = []
    pool = LeaderFollowers(ready.get, 4, name="t", shared=lambda: ready.put([]))
    pool.start()

    def blocks():  # a request waiting on something the next one does
        assert release.wait(20)
        ran.append("first")

    def unblocks():
        release.set()
        ran.append("second")
    ready.put([(blocks, ()), (unblocks, ())])
    end = time.monotonic() + 20
    while len(ran) < 2 and time.monotonic() < end:
        time.sleep(0.01)
    for _ in range(8):
        ready.put(None)
    pool.shutdown(wait=True)
    assert sorted(ran) == ["first", "second"] and pool.wakes >= 1
