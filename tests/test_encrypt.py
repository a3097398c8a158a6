"""Optional CURVE encryption (RpcBackendOptions(encrypt=True) / DISTGRAD_ENCRYPT=1):
an encrypted cluster works, and a plain zmq peer cannot complete the handshake."""
import pickle
import time

import pytest
import torch
import zmq
from mp_utils import run_workers

pytestmark = pytest.mark.timeout(120)


def _encrypted(rank, world_size):
    import distgrad.rpc as rpc
    agent = rpc.api.current_agent()
    assert agent.transport.encrypt
    out = rpc.rpc_sync(f"worker{(rank + 1) % world_size}", torch.add,
                       args=(torch.ones(300_000), 1)).sum().item()
    if rank != 0:
        return out, None
    endpoint = pickle.loads(agent.store.get("distgrad/worker/1"))[1].split("#")[0]
    ctx = zmq.Context()
    plain = ctx.socket(zmq.DEALER)
    plain.setsockopt(zmq.LINGER, 0)
    mon = plain.get_monitor_socket()
    plain.connect(endpoint)
    plain.send_multipart([b"\x00\x00\x00\x00", b"hello"])
    events = set()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        if mon.poll(100):
            from zmq.utils.monitor import parse_monitor_message
            events.add(parse_monitor_message(mon.recv_multipart())["event"])
    ctx.destroy(linger=0)
    return out, (zmq.EVENT_HANDSHAKE_SUCCEEDED in events,
                 bool(events & {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_DISCONNECTED,
                                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}))


def test_encrypted_cluster_and_plain_peer_refused():
    res = run_workers(_encrypted, world_size=2, timeout=90, options={"encrypt": True})
    assert [r[0] for r in res] == [600_000.0, 600_000.0]
    succeeded, failed = res[0][1]
    assert not succeeded and failed


def test_encrypt_needs_the_secret_and_agreement():
    from distgrad.transport.zmq_transport import ZmqTransport
    with pytest.raises(ValueError, match="secret"):
        ZmqTransport(0, encrypt=True)
    enc, plain = ZmqTransport(0, secret=b"s", encrypt=True), ZmqTransport(1, secret=b"s")
    try:
        a_enc, a_plain = enc.listen("127.0.0.1"), plain.listen("127.0.0.1")
        with pytest.raises(RuntimeError, match="encryption"):
            plain.start(None, {0: a_enc})
        with pytest.raises(RuntimeError, match="encryption"):
            enc.start(None, {1: a_plain})
    finally:
        enc.close(0)
        plain.close(0)
