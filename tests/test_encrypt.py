"""Optional encryption (RpcBackendOptions(encrypt=True) / DISTGRAD_ENCRYPT=1):
AES-GCM per frame (transport/crypto.py) with keys from the secret and the
handshake's challenges. An encrypted cluster works, a peer without encryption
(or without the secret) fails the handshake and never gets to send a frame,
and sealed frames cannot be tampered with, swapped or replayed."""
import os

import pytest
import torch
from mp_utils import run_workers

# cryptography is a hard dependency: an ImportError here is a failure, not a skip
from distgrad.transport import crypto

pytestmark = pytest.mark.timeout(180)



# -- FrameCipher -------------------------------------------------------------------
def _ciphers(secret=b"s", cc=None, sc=None):
    cc, sc = cc or os.urandom(16), sc or os.urandom(16)
    return crypto.FrameCipher(secret, 0, 1, cc, sc), crypto.FrameCipher(secret, 1, 0, cc, sc)


def test_cipher_round_trip_both_ways():
    a, b = _ciphers()
    big = os.urandom(300_000)
    for frames in ([b"envelope", b"tensor bytes"], [b""], [b"x", b"", big, memoryview(big)[:10]]):
        sealed = a.seal(list(frames))
        assert len(sealed) == len(frames) + 1
        assert all(bytes(memoryview(f)) not in bytes(s) for f, s in zip(frames, sealed[1:]) if len(f) > 8)
        assert [bytes(f) for f in b.open(sealed)] == [bytes(memoryview(f)) for f in frames]
    assert [bytes(f) for f in a.open(b.seal([b"back"]))] == [b"back"]


def test_cipher_rejects_tampering_swaps_and_replays():
    a, b = _ciphers()
    sealed = a.seal([b"envelope", b"bulk bytes"])
    for i in range(1, 3):  # a flipped bit anywhere in any frame
        bad = list(sealed)
        f = bytearray(bad[i])
        f[len(f) // 2] ^= 1
        bad[i] = bytes(f)
        with pytest.raises(crypto.AuthError, match="bad authentication tag"):
            b.open(bad)
    bad = list(sealed)
    bad[1], bad[2] = bad[2], bad[1]  # frames swapped
    with pytest.raises(crypto.AuthError):
        b.open(bad)
    same = a.seal([b"aaaa", b"bbbb"])  # frames of one length swapped (the nonce has the index)
    with pytest.raises(crypto.AuthError, match="bad authentication tag"):
        b.open([same[0], same[2], same[1]])
    with pytest.raises(crypto.AuthError):  # a frame cut short
        b.open([sealed[0], sealed[1], sealed[2][:-1]])
    with pytest.raises(crypto.AuthError):  # a frame dropped
        b.open(sealed[:2])
    with pytest.raises(crypto.AuthError):  # the sequence number changed
        b.open([bytes(8), *sealed[1:]])
    assert [bytes(f) for f in b.open(sealed)] == [b"envelope", b"bulk bytes"]
    with pytest.raises(crypto.AuthError, match="replayed"):  # accepted once only
        b.open(sealed)
    assert b.open(same) == [bytearray(b"aaaa"), bytearray(b"bbbb")]  # as sealed: next in line
    # a message deleted on the path: the next one is refused as a gap (the transport
    # then closes the connection); an older one after a newer one is a replay
    first, second = a.seal([b"1"]), a.seal([b"2"])
    with pytest.raises(crypto.SequenceGap, match="1 message"):
        b.open(second)
    assert b.open(first) == [bytearray(b"1")]
    assert b.open(second) == [bytearray(b"2")]
    with pytest.raises(crypto.AuthError, match="replayed"):
        b.open(first)
    # a seal that raised uses no number; rewind forgets messages sealed and never sent
    with pytest.raises(TypeError):
        a.seal([object()])
    mark = a.send_mark()
    a.seal([b"never sent"])
    a.rewind(mark)
    assert b.open(a.seal([b"3"])) == [bytearray(b"3")]
    # messages from the other direction, another connection or another secret never open
    with pytest.raises(crypto.AuthError):
        a.open(a.seal([b"mine"]))
    c, _ = _ciphers()
    with pytest.raises(crypto.AuthError):
        b.open(c.seal([b"x"]))
    cc, sc = os.urandom(16), os.urandom(16)
    d, _ = _ciphers(b"other", cc, sc)
    _, e = _ciphers(b"s", cc, sc)
    with pytest.raises(crypto.AuthError):
        e.open(d.seal([b"x"]))
    with pytest.raises(crypto.AuthError, match="missing sequence frame"):
        b.open([b"x"])


# -- a cluster -------------------------------------------------------------------
def _encrypted(rank, world_size):
    import raw_peer as rp

    import distgrad.rpc as rpc
    agent = rpc.api.current_agent()
    assert agent.transport.encrypt
    assert all(c.cipher is not None for c in agent.transport._conns.values())
    out = rpc.rpc_sync(f"worker{(rank + 1) % world_size}", torch.add,
                       args=(torch.ones(300_000), 1)).sum().item()
    if rank != 0:
        return out, None
    assert rp.worker_address(agent, 1)[2].get("enc") == "1"
    seen = {}
    for target in rp.targets(agent, 1):
        for name, flags in (("plain", 0), ("secret only", rp.F_SECRET), ("encrypt only", rp.F_ENCRYPT)):
            s = rp.connect(target)
            s.sendall(rp.hello(0, 1, flags))
            welcome = rp.read_welcome(s)
            # the worker states its settings, proves nothing to a mismatched client and
            # hangs up: the client never reaches the point of sending frames
            seen[str(target), name] = (welcome is not None and welcome[:3] == (rp.MAGIC, 1, 3)
                                       and len(welcome) == 4 and rp.closed_by_peer(s))
            s.close()
    return out, seen


def test_encrypted_cluster_and_plain_peer_refused():
    res = run_workers(_encrypted, world_size=2, timeout=120, options={"encrypt": True})
    assert [r[0] for r in res] == [600_000.0, 600_000.0]
    seen = res[0][1]
    assert seen and all(seen.values()), seen


def test_encrypt_needs_the_secret_and_agreement():
    from distgrad.transport.socket_transport import SocketTransport
    with pytest.raises(ValueError, match="secret"):
        SocketTransport(0, encrypt=True)
    enc, plain = SocketTransport(0, secret=b"s", encrypt=True), SocketTransport(1, secret=b"s")
    try:
        a_enc, a_plain = enc.listen("127.0.0.1"), plain.listen("127.0.0.1")
        assert "#enc=1" in a_enc and "#enc=" not in a_plain
        # found from the address tags in start(), before any connection is made
        with pytest.raises(RuntimeError, match="encryption on and this worker with it off"):
            plain.start(None, {0: a_enc})
        with pytest.raises(RuntimeError, match="encryption off and this worker with it on"):
            enc.start(None, {1: a_plain})
        assert enc._conns == {} and plain._conns == {}
    finally:
        enc.close(0)
        plain.close(0)
