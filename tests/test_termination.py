"""How a distributed backward ends: weight throwing, one-way gradient messages.

Gradients travel as one-way requests and every run returns its weight straight
to the initiator, so no reply climbs back through the hops of a chain. The
gradients are checked against single-process autograd (the oracle)."""
import time

import pytest
import torch
from mp_utils import run_workers

pytestmark = pytest.mark.timeout(120)

_state: dict = {}


def stage(x, k):
    return torch.tanh(x) * k


def remember(v):
    _state["v"] = v


def recall():
    return _state.get("v")


def mark_done():
    _state["done"] = True


def explode():
    raise ValueError("one-way boom")


def _sent(rpc, peer):
    return rpc._get_debug_info()[f"peer.worker{peer}"]["messages_sent"]


def _pipeline_messages(rank, world_size):
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    if rank != 0:
        return None
    torch.manual_seed(0)
    x = torch.randn(5, requires_grad=True)
    results = []
    for _ in range(3):
        with dist_autograd.context() as cid:
            h = rpc.rpc_sync(1, stage, args=(x, 2.0))       # driver -> stage 1 -> driver
            out = rpc.rpc_sync(2, stage, args=(h, 3.0))     # driver -> stage 2 -> driver
            loss = (out * out).sum()
            s1, s2 = _sent(rpc, 1), _sent(rpc, 2)
            dist_autograd.backward(cid, [loss])
            # the loss's gradient to stage 2, h's gradient to stage 1: nothing else
            results.append((_sent(rpc, 1) - s1, _sent(rpc, 2) - s2))
            got = dist_autograd.get_gradients(cid)[x]
    xl = x.detach().clone().requires_grad_(True)
    ((stage(stage(xl, 2.0), 3.0)) ** 2).sum().backward()
    torch.testing.assert_close(got, xl.grad)
    return results


def test_pipeline_backward_sends_one_message_per_hop():
    out = run_workers(_pipeline_messages, world_size=3, timeout=90)
    assert out[0] == [(1, 1)] * 3, out[0]


def _notify(rank, world_size):
    import distgrad.rpc as rpc
    from distgrad.rpc.agent import current_agent
    if rank != 0:  # stay out of shutdown (whose barrier sends messages) until rank 0 is done
        deadline = time.monotonic() + 30
        while "done" not in _state and time.monotonic() < deadline:
            time.sleep(0.01)
        return None
    agent = current_agent()
    assert rpc.rpc_sync(1, recall) is None  # (per-peer counters exist once a peer spoke)
    before = rpc._get_debug_info()["peer.worker1"]["messages_received"]
    assert agent.notify("worker1", remember, (7,)) is True
    deadline = time.monotonic() + 10
    calls = 1
    while rpc.rpc_sync(1, recall) != 7:
        assert time.monotonic() < deadline, "the one-way call never ran"
        time.sleep(0.01)
        calls += 1
    agent.notify(1, explode)  # fails there, logged there; nothing comes back
    assert rpc.rpc_sync(1, recall) == 7
    calls += 1
    assert agent.pending == {}
    # only the rpc_sync replies came back: none for either one-way call
    received = rpc._get_debug_info()["peer.worker1"]["messages_received"] - before
    rpc.rpc_sync(1, mark_done)
    return received, calls


def test_one_way_requests_run_remotely_without_reply():
    out = run_workers(_notify, world_size=2, timeout=60)
    received, calls = out[0]
    assert received == calls
