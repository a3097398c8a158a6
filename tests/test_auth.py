"""Authentication: nothing from a peer without the secret is unpickled."""
import os
import pickle
import time

import pytest
import torch
import zmq
from mp_utils import run_workers

from distgrad.transport.auth import Authenticator, AuthError

pytestmark = pytest.mark.timeout(120)


def test_seal_open_roundtrip_and_rejections():
    a, b = Authenticator(b"k", 0), Authenticator(b"k", 1)
    a.set_peer_nonce(1, b.nonce)
    b.set_peer_nonce(0, a.nonce)
    big = bytes(200_000)
    sealed = a.seal(1, [b"hdr", b"meta", big])
    assert [bytes(f) for f in b.open(0, sealed)] == [b"hdr", b"meta", big]
    with pytest.raises(AuthError, match="replayed"):
        b.open(0, sealed)
    tampered = a.seal(1, [b"evil envelope", b"bulk"])
    tampered[1] = b"good envelope"  # the envelope is covered in full
    with pytest.raises(AuthError, match="bad authentication tag"):
        b.open(0, tampered)
    truncated = a.seal(1, [b"hdr", big])
    truncated[2] = big[:-1]  # bulk frames are bound by length
    with pytest.raises(AuthError):
        b.open(0, truncated)
    # bulk bytes of the same length are not hashed (raw tensor data, never parsed)...
    swapped = a.seal(1, [b"hdr", b"aaaa"])
    swapped[2] = b"bbbb"
    assert [bytes(f) for f in b.open(0, swapped)] == [b"hdr", b"bbbb"]
    # ...unless the receiver demands it, or the sender covers more
    strict = Authenticator(b"k", 1, mac_bulk=True)
    strict.nonce = b.nonce
    strict.set_peer_nonce(0, a.nonce)
    with pytest.raises(AuthError, match="covers 1 of 2"):
        strict.open(0, a.seal(1, [b"hdr", b"aaaa"]))
    both = a.seal(1, [b"descriptor", b"envelope", b"bulk"], full=2)
    both[2] = b"envelopf"
    with pytest.raises(AuthError, match="bad authentication tag"):
        b.open(0, both)
    # a receiver that parses two frames refuses a message covering one in full
    with pytest.raises(AuthError, match="covers 1 of 3"):
        b.open(0, a.seal(1, [b"descriptor", b"envelope", b"bulk"]), min_full=2)
    # another secret, or an earlier session's nonce, never verifies
    c = Authenticator(b"other", 0)
    c.set_peer_nonce(1, b.nonce)
    with pytest.raises(AuthError):
        b.open(0, c.seal(1, [b"x"]))
    old = Authenticator(b"k", 1)  # same secret, new incarnation of worker 1
    old.set_peer_nonce(0, a.nonce)
    with pytest.raises(AuthError):
        old.open(0, a.seal(1, [b"x"]))


class _MakeFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _attack(rank, world_size, marker):
    import distgrad.rpc as rpc
    from distgrad.wire.messages import Kind, encode
    if rank == 0:
        agent = rpc.api.current_agent()
        addr = agent.store.get("distgrad/worker/1")
        endpoint = pickle.loads(addr)[1].split("#")[0]
        ctx = zmq.Context()
        payload = pickle.dumps((_MakeFile(marker), (), {}))
        frames = encode(Kind.CALL, 1, ("x", None, None), payload)
        for identity in (b"\x00\x00\x00\x00", b"intruder"):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, identity)
            s.connect(endpoint)
            s.send_multipart([b"\x00\x00\x00\x00" + bytes(28)] + frames)  # made-up MAC
            s.send_multipart([b"\x00\x00\x00\x00"] + frames)  # none at all
            s.send_multipart(frames)  # no transport frame
            s.send_multipart([b"\x80\x04garbage"])
        time.sleep(1.0)
        ctx.destroy(linger=0)
        # the worker keeps serving authenticated peers
        return rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)).tolist()
    return None


def test_forged_messages_are_never_unpickled(tmp_path):
    marker = str(tmp_path / "pwned")
    res = run_workers(_attack, world_size=2, timeout=90, args=(marker,))
    assert res[0] == [2.0, 2.0]
    assert not os.path.exists(marker)


def _mismatch(rank, world_size):
    return True


def test_wrong_secret_is_rejected_at_init():
    # one worker with a secret, one without: init fails clearly instead of talking
    with pytest.raises(AssertionError, match="cluster secret"):
        run_workers(_mismatch, world_size=2, timeout=60,
                    env_per_rank={0: {"DISTGRAD_SECRET": None}})


_HOT = {}


def _hot_tensor():
    """A small tensor another thread keeps changing in place (an optimizer, say)."""
    import threading
    if "t" not in _HOT:
        _HOT["t"] = torch.zeros(256)

        def spin():
            while True:
                _HOT["t"].add_(1)
        threading.Thread(target=spin, daemon=True).start()
    return _HOT["t"]


def _mutating(rank, world_size):
    import distgrad.rpc as rpc
    if rank != 0:
        return None
    values = [rpc.rpc_sync("worker1", _hot_tensor, timeout=10) for _ in range(300)]
    # Every reply verified and arrived (a dropped one would time out above). Its
    # values are not checked: add_ runs without the GIL, so the copy taken at call
    # time races the other thread, as it would in torch.
    return len(values) == 300 and all(v.shape == (256,) for v in values)


def test_tensor_changed_in_place_while_replying_still_verifies():
    assert run_workers(_mutating, world_size=2, timeout=90)[0]


def _different_secrets(rank, world_size):
    import distgrad.rpc as rpc
    from distgrad.errors import RPCTimeoutError, WorkerLostError
    other = f"worker{1 - rank}"
    t0 = time.monotonic()
    try:
        rpc.rpc_sync(other, torch.add, args=(torch.ones(1), 1), timeout=20)
    except (WorkerLostError, RPCTimeoutError) as e:
        return type(e).__name__, other in str(e), time.monotonic() - t0
    return "answered", False, 0.0


def test_a_wrong_secret_is_rejected():
    # Every message from a worker with another secret fails the MAC and is dropped,
    # heartbeats included: neither side ever runs the other's call, and each
    # declares the other lost once the heartbeat deadline passes.
    res = run_workers(_different_secrets, world_size=2, timeout=90,
                      env_per_rank={1: {"DISTGRAD_SECRET": "another-secret"}})
    for kind, names_peer, seconds in res:
        assert kind == "WorkerLostError" and names_peer, res
        assert seconds < 10, res
