"""A fork passed on by a non-owner: the callee runs once the owner confirmed it
(RpcTest.test_user_rrefs_confirmed / _remote), and confirmations that overtake
their fork are not lost."""
import threading
import time
import types

import pytest
import torch
from mp_utils import SLOW, run_workers

import distgrad.rpc as rpc
from distgrad.rpc.rref import RRefContext

pytestmark = pytest.mark.timeout(120)


def _fake_agent(rpc_timeout=60.0):
    return types.SimpleNamespace(control_handlers={}, rpc_timeout=rpc_timeout, lost={},
                                 shutting_down=False, rank=1, workers={}, dynamic=False)


def test_confirmation_before_or_after_the_fork():
    ctx = RRefContext(_fake_agent())
    early, late = ((2, 0), (0, 5)), ((2, 1), (0, 6))
    ctx._on_fork_confirm(2, *early)          # overtook the message carrying the fork
    ctx.add_unconfirmed(early)
    assert early not in ctx.unconfirmed and not ctx.early_confirmed
    ctx.add_unconfirmed(late)
    assert late in ctx.unconfirmed and ctx.debug_info()["num_pending_users"] == 1
    t = threading.Timer(0.3, ctx._on_fork_confirm, args=(2, *late))
    start = time.monotonic()   # before the timer starts: it fires 0.3 s after this at the earliest
    t.start()
    ctx.wait_confirmed(late, owner=2)          # woken by the confirmation
    # woken at the 0.3 s confirmation; the upper bound a hang guard
    assert late not in ctx.unconfirmed and 0.2 < time.monotonic() - start < 5 * SLOW


def test_wait_ends_when_the_owner_is_lost_or_at_the_timeout():
    agent = _fake_agent(rpc_timeout=0.4)
    ctx = RRefContext(agent)
    key = ((2, 0), (0, 1))
    ctx.add_unconfirmed(key)
    start = time.monotonic()
    ctx.wait_confirmed(key, owner=2)
    assert 0.3 < time.monotonic() - start < 5 * SLOW and key in ctx.unconfirmed  # at the 0.4 s timeout
    agent.rpc_timeout = 0  # no limit: only the loss ends it

    told = []

    def lose():
        agent.lost[2] = "gone"
        ctx.on_peer_lost(2, "gone")
        told.append(True)
    start = time.monotonic()   # before the timer starts (as above)
    threading.Timer(0.3, lose).start()
    ctx.wait_confirmed(key, owner=2)
    assert 0.2 < time.monotonic() - start < 5 * SLOW  # at the 0.3 s loss; a hang guard above
    deadline = time.monotonic() + 5
    while not told and time.monotonic() < deadline:
        time.sleep(0.01)
    assert told, "on_peer_lost raised (see the thread's traceback)"


def check_confirmed(rref):
    from distgrad.rpc.api import _get_current_rpc_agent
    info = _get_current_rpc_agent().rrefs.debug_info()
    return rref.confirmed_by_owner(), info["num_pending_users"], rref.to_here()


def _confirmed(rank, world_size):
    if rank != 0:
        return None
    for _ in range(5):
        rref = rpc.remote("worker2", torch.add, args=(torch.zeros(2), 1))  # owner: worker2
        ok, pending, value = rpc.rpc_sync("worker1", check_confirmed, args=(rref,))
        assert ok and pending == 0 and torch.equal(value, torch.ones(2))
        ok, pending, value = rpc.remote("worker1", check_confirmed, args=(rref,)).to_here()
        assert ok and pending == 0
        # sent by its owner: confirmed at once; back to its owner: the owner's own RRef
        ok, _, _ = rpc.rpc_sync("worker2", check_confirmed, args=(rref,))
        assert ok
    # a reply carrying a third party's fork does not wait; it is confirmed soon after
    rref = rpc.rpc_sync("worker1", rpc.remote, args=("worker2", torch.add, (torch.zeros(1), 2)))
    deadline = time.monotonic() + 10
    while not rref.confirmed_by_owner():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert torch.equal(rref.to_here(), torch.full((1,), 2.))
    return True


def test_user_rrefs_confirmed_inside_the_call():
    assert run_workers(_confirmed, world_size=3, timeout=90) == [True, None, None]
