"""A served call, a backward run and a callback use the intra-op thread count the
user set with ``torch.set_num_threads``, on whichever distgrad thread they run.

torch keeps that count per thread and another thread takes it when ATen first
initializes it; a distgrad thread that initialized it before the user's call kept
the old count (and a small matrix product on a Python thread never initializes it:
MKL then ran with OpenMP's whole team). The user's own threads keep theirs. See
``distgrad/intra_op.py``.
"""
from __future__ import annotations

import threading

import pytest
import torch
from mp_utils import run_workers

THREADS = 4
_BARRIER = threading.Barrier(THREADS)
_MAIN: dict = {}


def _count_on_busy_thread() -> tuple[str, int]:
    """Holds its thread until THREADS calls hold one each (so each runs on its own)."""
    n = torch.get_num_threads()
    _BARRIER.wait(timeout=30)
    return threading.current_thread().name, n


def _slow_add(x: torch.Tensor) -> torch.Tensor:
    threading.Event().wait(0.1)
    return x + 1


def _set_on_main(key: str, value) -> None:
    _MAIN[key] = value


def _main_has(key: str) -> bool:
    return key in _MAIN


def _hook_count(out: list):
    def hook(g):
        out.append(torch.get_num_threads())
        return g
    return hook


_HOOKED: list = []


def _forward_with_hook(x: torch.Tensor) -> torch.Tensor:
    w = torch.ones(3, requires_grad=True)
    w.register_hook(_hook_count(_HOOKED))
    return x * w


def _hooked() -> list:
    return list(_HOOKED)


def _counts(rank: int, world_size: int) -> dict:
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    if rank == 1:
        # worker1's main thread: set the count once worker0 says its threads ran calls
        while "n" not in _MAIN:
            threading.Event().wait(0.01)
        torch.set_num_threads(_MAIN["n"])
        _MAIN["set"] = True
        while not _MAIN.get("done"):
            threading.Event().wait(0.01)
        return {}

    # worker0's callbacks, first: callbacks registered before their replies come (the
    # calls sleep) run on distgrad's threads, which take the count then; the user sets
    # another count on the main thread; a later callback on one of those same threads
    # must run with it (without distgrad/intra_op.py it keeps the count it took).
    def callback_counts():
        futs = [rpc.rpc_async("worker1", _slow_add, args=(torch.ones(1),)).then(
            lambda f: (threading.current_thread().name, torch.get_num_threads()))
            for _ in range(THREADS)]
        return [f.wait() for f in futs]
    first: list = []
    for _ in range(20):   # a round whose callbacks all ran inline (registered late) counts none
        first = [c for c in callback_counts() if c[0].startswith("distgrad")]
        if first:
            break
    torch.set_num_threads(max(c for _, c in first) + 1)
    seen = {name for name, _ in first}
    second: list = []
    for _ in range(50):                    # until one lands on a thread seen above
        second += [c for c in callback_counts() if c[0].startswith("distgrad")]
        if any(name in seen for name, _ in second):
            break

    def burst():
        futs = [rpc.rpc_async("worker1", _count_on_busy_thread, timeout=60) for _ in range(THREADS)]
        return [f.wait() for f in futs]

    before = burst()                       # every one of worker1's serving threads initialized
    n = max(c for _, c in before) + 1      # a count none of them has
    rpc.rpc_sync("worker1", _set_on_main, args=("n", n))
    while not rpc.rpc_sync("worker1", _main_has, args=("set",)):
        threading.Event().wait(0.01)
    after = burst()
    with dist_autograd.context() as cid:   # a backward run on one of those threads
        x = torch.ones(3, requires_grad=True)
        y = rpc.rpc_sync("worker1", _forward_with_hook, args=(x,))
        dist_autograd.backward(cid, [y.sum()])
    hooked = rpc.rpc_sync("worker1", _hooked)
    # the user's own thread keeps its count: another user thread sets a new global;
    # this thread's calls (a reply it may read itself, the backward's share it runs)
    # leave its own count as the user left it, as torch does
    mine = torch.get_num_threads()
    other = threading.Thread(target=torch.set_num_threads, args=(mine + 1,))
    other.start()
    other.join()
    for _ in range(20):
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))
    with dist_autograd.context() as cid:
        x = torch.ones(3, requires_grad=True)
        y = rpc.rpc_sync("worker1", _forward_with_hook, args=(x,))
        dist_autograd.backward(cid, [(y * 2).sum()])
    kept = (mine, torch.get_num_threads())
    rpc.rpc_sync("worker1", _set_on_main, args=("done", True))
    return {"kept": kept, "before": before, "n": n, "after": after, "hooked": hooked,
            "callbacks": (first, second)}


@pytest.mark.timeout(120)
def test_served_calls_and_backward_take_the_users_set_num_threads():
    res = run_workers(_counts, world_size=2, timeout=90,
                      options={"num_worker_threads": THREADS})[0]
    n = res["n"]
    assert len({name for name, _ in res["before"]}) == THREADS
    # the threads that had initialized their count before the user set it take it now
    assert [c for _, c in res["after"]] == [n] * THREADS, res
    assert res["hooked"][0] == n, res
    first, second = res["callbacks"]
    assert first and second, res           # callbacks ran on distgrad's threads
    assert any(name in {n for n, _ in first} for name, _ in second), res
    want = max(c for _, c in first) + 1
    assert [c for _, c in second] == [want] * len(second), res
    mine, after_calls = res["kept"]
    assert after_calls == mine, res
