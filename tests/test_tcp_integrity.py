"""On TCP every byte is authenticated, tensors too (issue 35, item 5).

Two workers (spawn) on the cross-host path (``DISTGRAD_SAME_HOST=0``: TCP, no
shared memory). An attacker on the path, a proxy in the test process that the
receiver's published address leads through, flips one byte deep inside a 4 MiB
tensor on its way from worker0 to worker1. By default worker1 refuses the message
and closes the connection (the stream is not what worker0 sent): its function
never sees the changed tensor and the call fails at once as a lost worker, not
at its timeout; with
``DISTGRAD_MAC_TENSORS=0`` (the documented switch for trusted fabrics) the
change goes through, as it did for every TCP link before.
"""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from mp_utils import free_port, run_workers

pytestmark = pytest.mark.timeout(150)

FLIP_AT = (1 << 20) + 4321   # bytes into the worker0 -> worker1 stream: inside the tensor
SEEN: list[int] = []


def _sum(t):
    SEEN.append(int(t.sum()))
    return int(t.sum())


def _seen():
    return list(SEEN)


def _worker(rank: int, world_size: int, cfg: dict):
    import torch

    import distgrad.rpc as rpc
    from distgrad.transport.socket_transport import SocketTransport

    if rank == 1:   # publish the proxy's port: the attacker sits on the path to worker1
        orig = SocketTransport.listen

        def listen(self, host):
            addr = orig(self, host)
            real = self._tcp.getsockname()[1]
            with open(cfg["port_file"] + ".tmp", "w") as f:
                f.write(str(real))
            os.replace(cfg["port_file"] + ".tmp", cfg["port_file"])
            return addr.replace(f":{real}", f":{cfg['proxy']}", 1)

        SocketTransport.listen = listen
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{cfg['store']}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    out = None
    if rank == 0:
        try:
            out = ("returned", rpc.rpc_sync("worker1", _sum, args=(torch.zeros(4 << 20, dtype=torch.uint8),),
                                            timeout=8))
        except Exception as e:  # noqa: BLE001 - what happened is the result
            out = ("error", f"{type(e).__name__}: {e}")
        with open(cfg["done_file"], "w"):
            pass
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(cfg["done_file"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        out = _seen()
    rpc.shutdown(graceful=False)
    return out


class _Flipper:
    """Forwards connections to the port worker1 wrote, flipping the byte at FLIP_AT of
    the first stream that gets that far (client -> server)."""

    def __init__(self, port: int, port_file: str) -> None:
        self.sock = socket.create_server(("127.0.0.1", port))
        self.port_file, self.flipped, self.stop = port_file, 0, False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            while not os.path.exists(self.port_file):
                time.sleep(0.01)
            real = int(open(self.port_file).read())
            server = socket.create_connection(("127.0.0.1", real))
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, flip: bool) -> None:
        offset = 0
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if flip and not self.flipped and offset <= FLIP_AT < offset + len(data):
                    data = bytearray(data)
                    data[FLIP_AT - offset] ^= 0x01
                    self.flipped += 1
                offset += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.stop = True
        self.sock.close()


@pytest.mark.parametrize("mac_tensors", ["default", "0"])
def test_a_tensor_changed_on_the_path_is_refused_on_tcp(tmp_path, mac_tensors):
    proxy = free_port()
    cfg = {"store": free_port(), "proxy": proxy, "port_file": str(tmp_path / "port"),
           "done_file": str(tmp_path / "done")}
    env = {"DISTGRAD_SAME_HOST": "0"}
    if mac_tensors != "default":
        env["DISTGRAD_MAC_TENSORS"] = mac_tensors
    flipper = _Flipper(proxy, cfg["port_file"])
    try:
        out, seen = run_workers(_worker, world_size=2, init=False, timeout=120, args=(cfg,),
                                env_per_rank={0: env, 1: env})
    finally:
        flipper.close()
    assert flipper.flipped == 1, out
    what, value = out
    if mac_tensors == "default":   # refused: never handed to the function; the call fails
        assert what == "error" and seen == [], (out, seen)   # as a lost worker, not a timeout
        assert value.startswith("WorkerLostError"), out
    else:                          # the documented switch: the change goes through
        assert what == "returned" and value == 1 and seen == [1], out


@pytest.mark.parametrize("bulk", [1000, 1 << 20], ids=["small tensor: BLAKE2b", "large: Poly1305"])
def test_every_byte_seal_refuses_any_change_and_the_other_mode(bulk):
    from distgrad.transport.auth import Authenticator, AuthError
    a, b = Authenticator(os.urandom(32), 0), Authenticator(os.urandom(32), 1)
    a._secret = b._secret   # one cluster
    a.set_peer_nonce(1, b.nonce)
    b.set_peer_nonce(0, a.nonce)
    frames = [b"envelope", bytes(bulk), bytes(7)]
    assert [bytes(f) for f in b.open(0, a.seal(1, list(frames), 1, True), every=True)] == frames
    for i in (1, 2, 3):   # a flipped bit anywhere: envelope, large frame, last frame
        sealed = a.seal(1, list(frames), 1, True)
        sealed[i] = bytearray(sealed[i])
        sealed[i][len(sealed[i]) // 2] ^= 1
        with pytest.raises(AuthError, match="bad authentication tag"):
            b.open(0, sealed, every=True)
    with pytest.raises(AuthError, match="does not cover every byte"):
        b.open(0, a.seal(1, list(frames), 1), every=True)
    with pytest.raises(AuthError, match="where the link does not ask it"):
        b.open(0, a.seal(1, list(frames), 1, True))


def _seal_fails_once(rank: int, world_size: int):
    import torch

    import distgrad.rpc as rpc
    from distgrad.transport import auth

    real = auth.Authenticator.seal

    def seal(self, peer, frames, *a, **k):
        out = real(self, peer, frames, *a, **k)   # sealed (its number taken), then fails
        if any(b"FAIL-THIS-SEAL" in bytes(memoryview(f)) for f in frames[:2]):
            raise RuntimeError("seal failed")
        return out

    auth.Authenticator.seal = seal
    out = None
    if rank == 0:
        try:
            rpc.rpc_sync("worker1", len, args=("FAIL-THIS-SEAL",), timeout=10)
            out = ["sent"]
        except Exception as e:  # noqa: BLE001 - the call fails: its message was never sent
            out = [type(e).__name__]
        out.append(rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1), timeout=10).tolist())
    return out


def test_a_message_that_failed_to_seal_leaves_no_gap():
    """A batch whose sealing raised is never sent: its sequence numbers are given back,
    or the receiver would take the next message for one after a deletion (a gap) and
    close the connection."""
    out = run_workers(_seal_fails_once, world_size=2, timeout=60)[0]
    assert out[0] != "sent" and out[1] == [2.0, 2.0], out


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as ls:
        a = socket.create_connection(ls.getsockname(), timeout=10)
        b, _ = ls.accept()
    b.settimeout(10)
    return a, b


def test_two_connections_between_the_same_processes_have_their_own_mac_keys():
    """Issue 42, item 7 (defence in depth): without encryption the MAC keys were derived
    from the two processes' start-up nonces only, so every connection between the same
    two processes had the same keys. Two transports (ranks 0 and 1, one cluster secret)
    open two TCP connections to each other as the transport does (a real handshake, then
    ``_conn``): each has keys of its own, bound to its handshake's challenges, and a
    message sealed (every byte, as on TCP) for the first is refused on the second."""
    from distgrad.transport.auth import AuthError
    from distgrad.transport.handshake import client_handshake, server_handshake
    from distgrad.transport.socket_transport import SocketTransport
    t0, t1 = (SocketTransport(rank, secret=b"one cluster", num_threads=1) for rank in (0, 1))
    conns, keys, held = [], [], []
    try:
        t0._plan(1, f"tcp://127.0.0.1:9#auth={t1._auth.nonce.hex()}")   # as published
        t1._plan(0, f"tcp://127.0.0.1:9#auth={t0._auth.nonce.hex()}")
        for _ in range(2):
            a, b = _tcp_pair()
            box = {}
            server = threading.Thread(target=lambda box=box, b=b: box.update(
                s=server_handshake(b, 1, t1._secret, False, {0}, mac_all=True)))
            server.start()
            cc, sc = client_handshake(a, 0, 1, t0._secret, False, mac_all=True)
            server.join(20)
            assert box["s"] == (0, cc, sc)
            conns += [t0._conn(1, a, cc, sc), t1._conn(0, b, cc, sc)]
            assert conns[-2].mac_all and conns[-1].mac_all
            keys.append((t0._auth._send_keys[1], t0._auth._recv_keys[1]))
            assert keys[-1] == (t1._auth._recv_keys[0], t1._auth._send_keys[0])
            assert len(keys) == 1 or (keys[0][0] != keys[1][0] and keys[0][1] != keys[1][1]), \
                "two connections between the same processes share their MAC keys"
            frames = [b"envelope", bytes(100_000)]
            assert t1._auth.open(0, t0._auth.seal(1, list(frames), 1, True), every=True) == frames
            held.append(t0._auth.seal(1, [b"sealed on this connection"], 1, True))
        with pytest.raises(AuthError, match="bad authentication tag"):
            t1._auth.open(0, held[0], every=True)   # the first connection's, on the second
        assert t1._auth.open(0, held[1], every=True) == [b"sealed on this connection"]
    finally:
        for conn in conns:
            conn.sock.close()
        t0.close()
        t1.close()
