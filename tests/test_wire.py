"""Single-process tests of distgrad.wire: pickler round trips and framing checks."""
import pickle
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distgrad.errors import ProtocolError, SerializationError
from distgrad.wire import Kind, decode, dumps, encode, loads
from distgrad.wire.messages import HEADER, MAGIC, VERSION

pytestmark = pytest.mark.timeout(120)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.bool]


def roundtrip(obj, kind=Kind.CALL, rid=5, meta=("f", None, None)):
    payload, tensors = dumps(obj)
    frames = encode(kind, rid, meta, payload, tensors)
    frames = [bytes(memoryview(f)) for f in frames]  # as if received from a socket
    msg = decode(frames, sender=1)
    assert msg.kind == kind and msg.rid == rid and msg.meta == meta and msg.sender == 1
    return loads(msg.payload, msg.specs, msg.buffers), frames


def _sample(dtype):
    if dtype == torch.bool:
        return torch.tensor([True, False, True])
    if dtype.is_complex:
        return torch.randn(3, 2, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(3, 4).to(dtype)
    return torch.arange(0, 12).reshape(3, 4).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtype_roundtrip(dtype):
    t = _sample(dtype)
    out, _ = roundtrip(t)
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out, t)


def test_tensor_kinds():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    objs = {
        "zero_dim": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "empty_int": torch.zeros(2, 0, dtype=torch.int64),
        "transposed": base.t(),
        "strided": base[:, ::2],
        "expanded": torch.ones(1, 3).expand(4, 3),
        "conj": torch.randn(3, dtype=torch.complex64).conj(),
        "neg": torch.randn(3)._neg_view() if hasattr(torch.Tensor, "_neg_view") else torch.randn(3),
        "requires_grad": torch.ones(2, requires_grad=True),
    }
    out, _ = roundtrip(objs)
    for k, v in objs.items():
        assert out[k].shape == v.shape, k
        assert out[k].dtype == v.dtype, k
        assert torch.equal(out[k], v.detach().resolve_conj().resolve_neg()), k
    assert out["requires_grad"].requires_grad and not out["strided"].requires_grad
    assert out["zero_dim"].dim() == 0


def test_view_sends_only_its_bytes():
    big = torch.zeros(1_000_000)
    view = big[10:20]
    _, frames = roundtrip(view)
    assert sum(len(f) for f in frames) < 2000
    out, _ = roundtrip(big[::100000])
    assert out.shape == (10,)


def test_sparse_parameter_nested():
    sp = torch.sparse_coo_tensor(torch.tensor([[0, 1, 2], [2, 0, 1]]), torch.tensor([1., 2., 3.]),
                                 (3, 3))
    param = torch.nn.Parameter(torch.randn(2, 2))
    obj = [1, ("a", {"s": sp, "p": param, "nested": [[torch.ones(1)], (torch.zeros(2),)]}), None]
    out, _ = roundtrip(obj)
    assert out[0] == 1 and out[2] is None and out[1][0] == "a"
    d = out[1][1]
    assert d["s"].is_sparse and torch.equal(d["s"].to_dense(), sp.to_dense())
    assert isinstance(d["p"], torch.nn.Parameter) and d["p"].requires_grad
    assert torch.equal(d["p"], param)
    assert torch.equal(d["nested"][0][0], torch.ones(1))
    assert isinstance(d["nested"][1], tuple)


def test_shared_tensor_identity_kept():
    t = torch.ones(3)
    out, frames = roundtrip([t, t])
    assert out[0] is out[1]
    assert len(frames) == 2  # the envelope and one buffer


def test_builtins_and_functions():
    out, _ = roundtrip((torch.add, len, test_builtins_and_functions))
    assert out == (torch.add, len, test_builtins_and_functions)


def test_unpicklable_raises_serialization_error():
    with pytest.raises(SerializationError, match="cannot pickle") as ei:
        dumps((lambda x: x, 1))
    assert isinstance(ei.value, TypeError) and isinstance(ei.value, RuntimeError)


def _frames():
    payload, tensors = dumps({"a": torch.arange(4), "b": torch.ones(2, 2)})
    return [bytes(memoryview(f)) for f in encode(Kind.CALL, 1, ("f", None, None), payload, tensors)]


def _split(env):
    """(header fields, meta bytes, payload bytes) of an envelope."""
    fields = HEADER.unpack_from(env)
    meta_end = HEADER.size + fields[-1]
    return fields, env[HEADER.size:meta_end], env[meta_end:]


def _envelope(meta, payload, magic=MAGIC, version=VERSION, kind=int(Kind.CALL), nbuf=2, rid=1,
              meta_len=None):
    n = len(meta) if meta_len is None else meta_len
    return HEADER.pack(magic, version, kind, nbuf, rid, n) + meta + payload


def test_one_envelope_frame_then_buffers():
    good = _frames()
    assert len(good) == 3  # envelope + 2 tensor buffers
    (magic, version, kind, nbuf, rid, meta_len), meta, payload = _split(good[0])
    assert (magic, version, kind, nbuf, rid) == (MAGIC, VERSION, int(Kind.CALL), 2, 1)
    assert pickle.loads(meta)[0] == ("f", None, None)
    msg = decode(good)
    assert bytes(msg.payload) == payload


def test_protocol_errors():
    good = _frames()
    env, bufs = good[0], good[1:]
    _, meta, payload = _split(env)
    msg = decode(good)
    loads(msg.payload, msg.specs, msg.buffers)
    with pytest.raises(ProtocolError, match="no frames"):
        decode([])
    with pytest.raises(ProtocolError, match="buffers"):
        decode(good[:-1])  # header says 2 buffers, 1 present
    with pytest.raises(ProtocolError, match="buffers"):
        decode(good + [b"extra"])
    with pytest.raises(ProtocolError, match="header"):
        decode([env[:HEADER.size - 1]] + bufs)
    with pytest.raises(ProtocolError, match="meta"):  # meta length beyond the envelope
        decode([_envelope(meta, b"", meta_len=len(meta) + 1)] + bufs)
    with pytest.raises(ProtocolError, match="magic"):
        decode([_envelope(meta, payload, magic=b"XX")] + bufs)
    with pytest.raises(ProtocolError, match="version"):
        decode([_envelope(meta, payload, version=VERSION + 1)] + bufs)
    with pytest.raises(ProtocolError, match="kind"):
        decode([_envelope(meta, payload, kind=99)] + bufs)
    with pytest.raises(ProtocolError, match="meta"):
        decode([_envelope(b"garbage", payload)] + bufs)
    # size mismatch of a tensor buffer
    msg = decode([env, bufs[0][:-1], bufs[1]])
    with pytest.raises(ProtocolError, match="bytes"):
        loads(msg.payload, msg.specs, msg.buffers)
    # buffers swapped: sizes differ (32 vs 16 bytes)
    msg = decode([env, bufs[1], bufs[0]])
    with pytest.raises(ProtocolError):
        loads(msg.payload, msg.specs, msg.buffers)
    # specs naming an unknown dtype
    meta_obj, specs = pickle.loads(meta)
    for bad, match in [((("torch.evil", (2,), False, 0),) + specs[1:], "spec"),
                       ((("torch.int64", (-4,), False, 0),) + specs[1:], "shape"),
                       (specs + specs, None)]:  # more specs than buffers
        msg = decode([_envelope(pickle.dumps((meta_obj, bad)), payload)] + bufs)
        with pytest.raises(ProtocolError, match=match):
            loads(msg.payload, msg.specs, msg.buffers)
    # specs not a tuple
    with pytest.raises(ProtocolError):
        decode([_envelope(pickle.dumps((meta_obj, "nope")), payload)] + bufs)


def _decode_and_load(frames):
    try:
        msg = decode(frames)
        if msg.kind in (Kind.CALL, Kind.REMOTE, Kind.REPLY):
            try:
                loads(msg.payload, msg.specs, msg.buffers)
            except ProtocolError:
                pass
            except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
                    ImportError, KeyError, IndexError, UnicodeDecodeError, OverflowError,
                    MemoryError):
                # the payload is an ordinary pickle: garbled pickles raise pickle's own errors
                pass
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=6))
def test_fuzz_random_frames(frames):
    _decode_and_load(frames)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2), st.integers(0, 10_000), st.integers(0, 255),
       st.sampled_from(["flip", "truncate", "drop", "dup"]))
def test_fuzz_mutated_frames(which, pos, byte, how):
    frames = [bytearray(f) for f in _frames()]
    f = frames[which]
    if how == "flip" and f:
        f[pos % len(f)] = byte
    elif how == "truncate":
        del f[pos % (len(f) + 1):]
    elif how == "drop":
        del frames[which]
    else:
        frames.insert(which, bytearray(f))
    _decode_and_load([bytes(x) for x in frames])


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 255), st.integers(0, 255), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1),
       st.integers(0, 2**32 - 1))
def test_fuzz_headers(version, kind, nbuf, rid, meta_len):
    meta = pickle.dumps((None, ()))
    head = struct.pack("!2sBBIQI", MAGIC, version, kind, nbuf, rid, meta_len)
    try:
        msg = decode([head + meta] + [b"x"] * min(nbuf, 3))
    except ProtocolError:
        return
    assert version == VERSION and nbuf <= 3 and msg.rid == rid and len(msg.buffers) == nbuf
    assert meta_len == len(meta)
