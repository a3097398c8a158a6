"""Fuzzing the receive path: wire.messages.decode, then pickler.loads
(rebuild_tensors + unpickling), exactly as the agent runs them on received
frames.

Contract checked here (see decode's and loads' docstrings):

* ``decode`` raises ProtocolError and nothing else;
* ``loads`` (on a decoded message) raises ProtocolError (specs, buffer sizes,
  tensor references), SerializationError (the payload does not unpickle), or
  ImportError/AttributeError (the payload names a module or attribute that does
  not exist here, kept as is for torch compatibility);
* neither hangs, and neither allocates for a size a frame *declares*: the
  tracemalloc peak of every example stays under ``PEAK_BOUND`` (the frames
  are at most a few KiB).

Unpickling a payload runs the callables it names: that is what RPC is for,
and only authenticated peers get that far (see the README's trust model).
A mutation can turn ``torch.add`` into ``torch.ones`` with a huge argument,
so here the payload may only name what the seed messages name (an allow-list
on ``find_class``); everything before unpickling is fuzzed unrestricted.

Inputs: random frame lists, and valid encodings of assorted messages mutated by
byte flips, bit flips, truncation, insertion, frame drops/duplications/swaps
and header rewrites.

Default: ``DISTGRAD_FUZZ_EXAMPLES`` = 1000 examples per test, 4000 in all (about 15 s in
all). A long run::

    DISTGRAD_FUZZ_EXAMPLES=100000 pytest tests/test_fuzz.py -p no:timeout
"""
import io
import os
import pickle
import struct
import tracemalloc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distgrad.errors import ProtocolError, SerializationError
from distgrad.wire import Kind, decode, dumps, encode, loads
from distgrad.wire.messages import HEADER, MAGIC, VERSION

N = int(os.environ.get("DISTGRAD_FUZZ_EXAMPLES", "1000"))
PEAK_BOUND = 8 << 20  # bytes allocated while handling one example
SETTINGS = settings(max_examples=N, deadline=None)

pytestmark = pytest.mark.timeout(max(120, N // 50))


def _seeds():
    objs = [
        (torch.add, (torch.ones(3), 1), {}),
        {"a": torch.arange(6).reshape(2, 3), "b": torch.ones(2, 2, dtype=torch.float64),
         "e": torch.empty(0, 4), "s": "text", "n": [1, 2.5, None, b"\x00\x01"]},
        [torch.tensor(3.5), torch.zeros(4, dtype=torch.bool), torch.ones(2, requires_grad=True)],
        torch.nn.Parameter(torch.randn(3, 2)),
        ("just", "a", "tuple", 12345678901234567890),
        # strided views travel with their strides: an offset narrow view, an expanded one
        [torch.arange(25.).reshape(5, 5).narrow(1, 2, 2), torch.ones(1, 3).expand(4, 3)],
    ]
    out = []
    for i, obj in enumerate(objs):
        payload, tensors = dumps(obj)
        kind = [Kind.CALL, Kind.REPLY, Kind.REMOTE][i % 3]
        out.append([bytes(memoryview(f)) for f in
                    encode(kind, 1000 + i, ("some.func", None, None), payload, tensors)])
    return out


SEEDS = _seeds()


def _payload(envelope: bytes) -> bytes:
    return envelope[HEADER.size + HEADER.unpack_from(envelope)[-1]:]


def _envelope(meta: bytes, payload: bytes, nbuf: int, version=VERSION, kind=int(Kind.CALL), rid=1,
              meta_len=None) -> bytes:
    n = len(meta) if meta_len is None else meta_len
    return HEADER.pack(MAGIC, version, kind, nbuf, rid, n) + meta + payload


def _seed_globals() -> set:
    import pickletools
    names, strings = set(), []
    for frames in SEEDS:
        for op, arg, _ in pickletools.genops(_payload(frames[0])):
            if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
                strings.append(arg)
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.add((strings[-2], strings[-1]))
            elif op.name == "GLOBAL":
                names.add(tuple(arg.split(" ", 1)))
    return names


_ALLOWED_GLOBALS = _seed_globals()


@pytest.fixture(autouse=True)
def _only_seed_globals(monkeypatch):
    from distgrad.wire import pickler

    def checked_getattr(obj, name, *default):
        # torch functions pickle as getattr(torch._C._VariableFunctionsClass, "add"):
        # a flipped byte must not make that "eye" or "ones"
        if name != "add":
            raise pickle.UnpicklingError(f"fuzzed payload asks for attribute {name!r}")
        return getattr(obj, name, *default)

    def find_class(self, module, name):
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"fuzzed payload names {module}.{name}")
        if (module, name) == ("builtins", "getattr"):
            return checked_getattr
        return pickle.Unpickler.find_class(self, module, name)
    monkeypatch.setattr(pickler._Unpickler, "find_class", find_class, raising=False)
_ALLOWED_LOADS = (ProtocolError, SerializationError, ImportError, AttributeError)


def _receive(frames):
    """What the agent does with received frames; returns a label of the outcome."""
    try:
        msg = decode(frames, sender=1)
    except ProtocolError:
        return "decode-error"
    # anything else escaping decode fails the test
    try:
        loads(msg.payload, msg.specs, msg.buffers)
    except _ALLOWED_LOADS:
        return "loads-error"
    return "ok"


def _memo_indices(frames) -> list:
    """The LONG_BINPUT indices at the payload's opcode positions (as pickletools reads it)."""
    import pickletools
    data = bytes(decode(frames, sender=1).payload)
    out = []
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(data)):
            if op.code == "r":
                out.append(arg)
    except ValueError:  # garbled after them
        pass
    return out


def _assert_bounded(frames):
    tracemalloc.start()
    try:
        _receive(frames)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BOUND, f"peak {peak} bytes for frames of {[len(f) for f in frames]} bytes"


@SETTINGS
@given(st.lists(st.binary(max_size=256), min_size=0, max_size=8))
def test_fuzz_random_frames(frames):
    _assert_bounded(frames)


@SETTINGS
@given(st.binary(max_size=200), st.binary(max_size=200), st.lists(st.binary(max_size=200), max_size=4),
       st.integers(0, 255), st.integers(0, 255), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1),
       st.integers(0, 2**32 - 1))
def test_fuzz_valid_header_random_rest(meta, payload, rest, version, kind, nbuf, rid, meta_len):
    version = VERSION if version < 200 else version  # mostly the right version
    nbuf = len(rest) if nbuf % 4 else nbuf  # mostly a matching count
    meta_len = len(meta) if meta_len % 4 else meta_len  # mostly the true length
    _assert_bounded([_envelope(meta, payload, nbuf, version, kind, rid, meta_len), *rest])


_MUTATION = st.tuples(
    st.sampled_from(["byte", "bit", "truncate", "insert", "drop", "dup", "swap", "nbuf",
                     "metalen", "declare"]),
    st.integers(0, 2**16), st.integers(0, 2**16), st.integers(0, 255))


def _mutate(frames, how, a, b, byte):
    frames = [bytearray(f) for f in frames]
    if not frames:
        return frames
    i = a % len(frames)
    f = frames[i]
    if how == "byte" and f:
        f[b % len(f)] = byte
    elif how == "bit" and f:
        f[b % len(f)] ^= 1 << (byte % 8)
    elif how == "truncate":
        del f[b % (len(f) + 1):]
    elif how == "insert":
        f[b % (len(f) + 1):b % (len(f) + 1)] = bytes([byte]) * (1 + byte % 9)
    elif how == "drop":
        del frames[i]
    elif how == "dup":
        frames.insert(i, bytearray(f))
    elif how == "swap":
        j = b % len(frames)
        frames[i], frames[j] = frames[j], frames[i]
    elif how == "nbuf" and len(frames[0]) >= HEADER.size:
        struct.pack_into("!I", frames[0], 4, b)
    elif how == "metalen" and len(frames[0]) >= HEADER.size:
        struct.pack_into("!I", frames[0], 16, b * byte)
    elif how == "declare" and f:
        # a length-prefixed pickle opcode declaring a huge size, or a huge memo index, spliced in
        op = [b"B" + struct.pack("<I", 2**32 - 1), b"\x8e" + struct.pack("<Q", 2**62),
              b"\x96" + struct.pack("<Q", 2**40), b"\x95" + struct.pack("<Q", 2**62),
              b"r" + struct.pack("<I", 2**22 + byte), b"p%d\n" % (2**22 + byte)][byte % 6]
        pos = b % (len(f) + 1)
        f[pos:pos + len(op)] = op
    return frames


@SETTINGS
@given(st.sampled_from(range(len(SEEDS))), st.lists(_MUTATION, min_size=1, max_size=4))
def test_fuzz_mutated_valid_frames(seed, mutations):
    frames = SEEDS[seed]
    for m in mutations:
        frames = _mutate(frames, *m)
    _assert_bounded([bytes(f) for f in frames])


@SETTINGS
@given(st.sampled_from(["torch.float32", "torch.int64", "torch.bool", "torch.evil", 7, None]),
       st.lists(st.integers(-2, 2**64), max_size=70), st.sampled_from([True, False, 1, "x"]),
       st.integers(-1, 3), st.integers(0, 3),
       st.one_of(st.none(), st.lists(st.integers(-2, 2**64), max_size=6)))
def test_fuzz_specs(dtype, shape, requires_grad, kind, nbuf, strides):
    # well-formed message around arbitrary specs (strided views' strides too):
    # sizes and spans are checked before any allocation
    spec = (dtype, tuple(shape), requires_grad, kind)
    if strides is not None:
        spec += ((), tuple(strides))
    meta = pickle.dumps((("f", None, None), (spec,)), protocol=5)
    payload, _ = dumps([1, 2])
    _assert_bounded([_envelope(meta, payload, nbuf)] + [bytes(16)] * nbuf)


def test_memo_index_bombs_are_refused():
    """A LONG_BINPUT or PUT naming a memo index larger than the pickle: the C
    unpickler would size its memo by it (20 GB for the one bit flip below, which
    shortens a name so that its "r" becomes an opcode); check_pickle refuses it."""
    frames = [bytes(f) for f in _mutate(SEEDS[5], "bit", 0, 355, 0)]  # "_table_tenso" + r<index>
    payload = bytes(decode(frames).payload)
    assert any(i > len(payload) for i in _memo_indices(frames))
    _assert_bounded(frames)
    with pytest.raises(SerializationError, match="memo index"):
        msg = decode(frames)
        loads(msg.payload, msg.specs, msg.buffers)
    # the same in the meta pickle, and with PUT's decimal index
    for bomb in (b"\x80\x05Nr\x00\x00\x00\x40.", b"\x80\x05Np1073741824\n.", b"(Np +1_073_741_824\n."):
        with pytest.raises(ProtocolError, match="memo index"):
            decode([_envelope(bomb, b"", 0)])
        with pytest.raises(SerializationError, match="memo index"):
            loads(bomb)
    # small indices (as pickles of protocols 0-3 write them) still load
    for proto in range(4):
        obj = [("r" * 300, "p" * 300, 12345678901234567890)] * 3
        assert loads(pickle.dumps(obj, protocol=proto)) == obj


def test_seeds_decode_and_load():
    assert all(_receive(f) == "ok" for f in SEEDS)


def test_declared_sizes_never_allocate():
    payload = b"\x80\x05\x8e" + struct.pack("<Q", 2**40)
    frames = list(SEEDS[0])
    meta = frames[0][HEADER.size:len(frames[0]) - len(_payload(frames[0]))]
    frames[0] = _envelope(meta, payload, len(frames) - 1)
    _assert_bounded(frames)
    with pytest.raises(SerializationError):
        msg = decode(frames)
        loads(msg.payload, msg.specs, msg.buffers)
    frames[0] = _envelope(b"\x80\x05B" + struct.pack("<I", 2**32 - 1), payload, len(frames) - 1)
    with pytest.raises(ProtocolError, match="meta"):
        decode(frames)
