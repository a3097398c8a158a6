"""Shipped gradients in their own layout (wire/fast_header.py ``encode_grads`` /
``grads_args``, ``Kind.GRADS``): no pickle on either side.

Checked: the receiver gets exactly the arguments the sender gave (types, values,
tensors' bytes, None slots, unreached slots); what the layout cannot carry goes the
general way (the agent then pickles the same call); every malformed block, table or
header raises ProtocolError; the agent serves a gradient message as the NOTIFY it
replaces (the same call, no reply) and drops a malformed one with a warning; a small
gradient is snapshotted when the message is built.
"""
import struct
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distgrad.errors import ProtocolError
from distgrad.rpc import fast_path
from distgrad.rpc.agent import RpcAgent
from distgrad.rpc.worker_info import WorkerInfo
from distgrad.wire import Kind, decode, dumps, encode
from distgrad.wire.fast_header import FAST, GRADS_BLOCK, decode_fast, encode_grads, grads_args

pytestmark = pytest.mark.timeout(120)

_CTX, _MSG = (3 << 48) | 17, (1 << 48) | 99


def _args(grads, unreached=(), exp=3):
    return (_CTX, (2, 41), 2, 1, _MSG, list(grads), exp, list(unreached))


def _roundtrip(args):
    frames = encode_grads(7, args)
    assert frames is not None and bytes(frames[0][:2]) == b"DF"
    msg = decode_fast([bytearray(f) for f in frames])
    assert msg.kind is Kind.GRADS and msg.rid == 7
    return grads_args(msg)


def _same_args(a, b):
    assert len(a) == len(b) == 8
    assert a[:5] == b[:5] and a[6:] == b[6:]
    assert type(b[1]) is tuple and type(b[5]) is list and type(b[7]) is list
    assert len(a[5]) == len(b[5])
    for x, y in zip(a[5], b[5]):
        if x is None:
            assert y is None
        else:
            assert type(y) is torch.Tensor and x.dtype == y.dtype and x.shape == y.shape
            assert not y.requires_grad and torch.equal(x, y)


@pytest.mark.parametrize("grads,unreached", [
    ([torch.randn(64, 16)], []),
    ([None, torch.randn(3, 2, dtype=torch.float64), None], [0, 2]),
    ([torch.randn(70_000)], []),                     # zero-copy buffer
    ([torch.empty(0, 4), torch.tensor(2.5), torch.ones(2, dtype=torch.float16)], []),
    ([torch.arange(5), torch.zeros(3, dtype=torch.bool)], [1]),
    ([], []),
    ([None], [0]),
])
def test_the_receiver_gets_the_senders_arguments(grads, unreached):
    args = _args(grads, unreached)
    _same_args(args, _roundtrip(args))


def test_extreme_fields_round_trip():
    args = (-(1 << 63), ((1 << 63) - 1, 0), 0, (1 << 63) - 1, -5, [torch.ones(1)], (1 << 64) - 1, [])
    _same_args(args, _roundtrip(args))


@pytest.mark.parametrize("args", [
    _args([torch.randn(2, requires_grad=True)]),          # a gradient with a graph
    _args([torch.nn.Parameter(torch.randn(2))]),
    _args([torch.randn(4, 4).t()]),                       # not contiguous
    _args([torch.randn(2, dtype=torch.complex64)]),       # a dtype the table lacks
    _args([torch.randn(2).to_sparse()]),
    _args([torch.randn(2)], exp=-1),
    _args([torch.randn(2)], exp=1 << 64),
    _args([torch.randn(2)], unreached=[1]),               # a slot past the gradients
    _args([torch.randn(2)], unreached=[True]),
    (_CTX, [2, 41], 2, 1, _MSG, [torch.ones(1)], 3, []),  # pass id not a tuple
    (_CTX, (2, 41), 2, 1 << 63, _MSG, [torch.ones(1)], 3, []),
    (_CTX, (2, 41), 2, 1, _MSG, (torch.ones(1),), 3, []),
    (_CTX, (2, 41), 2, 1, _MSG, [torch.ones(1)], 3),
])
def test_what_the_layout_cannot_carry_goes_the_general_way(args):
    assert encode_grads(1, args) is None


def test_a_small_gradient_is_snapshotted():
    g = torch.ones(8)
    frames = encode_grads(1, _args([g]))
    g.add_(1)
    assert torch.equal(grads_args(decode_fast([bytearray(f) for f in frames]))[5][0], torch.ones(8))


def _block_at(frames):
    """Offset of the gradient block in the envelope (after header and table)."""
    return len(frames[0]) - len(decode_fast([bytearray(f) for f in frames]).payload)


def _parse(env, rest):
    return grads_args(decode_fast([env, *rest]))


def test_every_block_field_is_checked():
    frames = encode_grads(1, _args([None, torch.randn(3)], unreached=[0]))
    at = _block_at(frames)
    env = bytearray(frames[0])
    n_at = at + GRADS_BLOCK.size - 4
    present_at = at + GRADS_BLOCK.size
    cases = {
        "block cut short": env[:at + GRADS_BLOCK.size - 1],
        "a byte too many": env + b"\0",
        "a slot cut short": env[:-1],
        "more gradients announced": _put(env, n_at, "!H", 3),
        "more slots announced": _put(env, n_at + 2, "!H", 2),
        "presence byte 2": _put(env, present_at + 1, "!B", 2),
        "tensor without a present slot": _put(env, present_at + 1, "!B", 0),
        "present slot without a tensor": _put(env, present_at, "!B", 1),
        "slot out of range": _put(env, len(env) - 2, "!H", 2),
    }
    for what, bad in cases.items():
        with pytest.raises(ProtocolError):
            _parse(bytearray(bad), [bytearray(f) for f in frames[1:]])
            pytest.fail(what)


def _put(env, at, fmt, value):
    out = bytearray(env)
    struct.pack_into(fmt, out, at, value)
    return out


def test_the_table_and_header_are_checked():
    frames = encode_grads(1, _args([torch.randn(3)]))
    env = bytearray(frames[0])
    rest = [bytearray(f) for f in frames[1:]]
    with pytest.raises(ProtocolError, match="names no function"):   # a gradient message names nothing
        decode_fast([_put(env, 16, "!H", 1), *rest])
    with pytest.raises(ProtocolError):   # flags: requires grad / Parameter on a gradient
        _parse(_put(env, FAST.size + 1, "!B", 1), rest)
    with pytest.raises(ProtocolError):
        _parse(_put(env, FAST.size + 1, "!B", 2), rest)
    with pytest.raises(ProtocolError):   # a buffer of the wrong size
        _parse(env, [rest[0][:-4]])
    # only the fast envelope carries gradients: a general one of kind GRADS is refused
    data, tensors = dumps((print, (1,), {}))
    general = [bytearray(f) for f in encode(Kind.NOTIFY, 3, ("m.f", None, None), data, tensors)]
    assert general[0][:2] == b"DG" and decode(general).kind is Kind.NOTIFY
    general[0][3] = int(Kind.GRADS)
    with pytest.raises(ProtocolError):
        decode(general)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_gradient_messages_raise_protocol_error_or_parse(data):
    frames = encode_grads(1, _args([None, torch.randn(3), torch.randn(2)], unreached=[0]))
    env = bytearray(frames[0])
    for _ in range(data.draw(st.integers(1, 4))):
        env[data.draw(st.integers(0, len(env) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(env)))
    try:
        msg = decode_fast([env[:cut], *[bytearray(f) for f in frames[1:]]])
        if msg.kind is not Kind.GRADS:
            return
        args = grads_args(msg)
    except ProtocolError:
        return
    assert type(args[1]) is tuple and len(args) == 8
    assert sum(g is not None for g in args[5]) == len(msg.tensors)
    assert all(0 <= i < len(args[5]) for i in args[7])


# -- the agent ---------------------------------------------------------------------
class _Transport:
    pool = None

    def __init__(self):
        self.sent = []

    def send(self, peer, frames):
        self.sent.append((peer, [bytearray(f) for f in frames]))


_GOT: list = []


def receiver(*args):
    """The test's gradient function (module level: the general layout pickles it by name)."""
    _GOT.append(args)


@pytest.fixture
def agent():
    got = _GOT
    got.clear()
    saved = fast_path.GRADIENT_RECEIVER[0]
    fast_path.GRADIENT_RECEIVER[0] = receiver
    opts = types.SimpleNamespace(rpc_timeout=5.0, num_worker_threads=1)
    a = RpcAgent("worker0", 0, 2, [WorkerInfo("worker0", 0), WorkerInfo("worker1", 1)], _Transport(),
                 opts)
    a.got = got
    try:
        yield a
    finally:
        fast_path.GRADIENT_RECEIVER[0] = saved


def test_the_agent_serves_a_gradient_message_as_the_notify_it_replaces(agent):
    args = _args([torch.randn(4, 2), None], unreached=[1])
    assert agent.notify(1, fast_path.GRADIENT_RECEIVER[0], args, reverse=True)
    peer, frames = agent.transport.sent.pop()
    assert peer == 1 and frames[0][:2] == b"DF" and FAST.unpack_from(frames[0])[2] == int(Kind.GRADS)
    fn, (sender, msg) = agent.on_message(0, frames)
    assert msg.kind == Kind.NOTIFY and msg.meta[0].endswith("receiver")
    fn(sender, msg)
    _same_args(args, agent.got.pop())
    assert not agent.transport.sent and agent.inflight == 0   # no reply
    assert agent.on_message(0, frames) is None                # a repeat is dropped


def test_other_calls_and_unfit_gradients_take_the_pickled_notify(agent):
    args = _args([torch.randn(4, 4).t()])
    agent.notify(1, fast_path.GRADIENT_RECEIVER[0], args)
    agent.notify(1, print, (1,))
    for _, frames in agent.transport.sent:
        assert FAST.unpack_from(frames[0])[2] == int(Kind.NOTIFY)
    fn, (sender, msg) = agent.on_message(0, agent.transport.sent[0][1])
    fn(sender, msg)
    _same_args(args, agent.got.pop())


def test_the_agent_drops_a_malformed_gradient_message(agent, caplog):
    frames = encode_grads(5, _args([torch.randn(3)]))
    env = _put(bytearray(frames[0]), len(frames[0]) - 1, "!B", 7)   # presence byte 7
    assert agent.on_message(1, [env, *[bytearray(f) for f in frames[1:]]]) is None
    assert "malformed" in caplog.text and not agent.got and not agent.transport.sent
