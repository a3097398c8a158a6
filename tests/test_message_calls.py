"""The Python function calls one small request costs on each side (issue 27).

Every thread of both workers runs under a profile function that counts Python
function calls (``sys.setprofile`` / ``threading.setprofile``, installed before
``init_rpc`` so the transport's threads inherit it); the counts over 1,000
``rpc_sync(torch.add, (ones(4), 1))`` to the other worker, divided by 1,000,
are the calls per message on the caller (send, read the reply, complete it) and
on the callee (read, dispatch, unpickle, run, reply). They must stay under the
bounds below, so that the common path cannot silently grow again.

The workers run the interpreted message path (``DISTGRAD_PURE=1``): the bound is
on the ``.py`` sources, which stay the reference wherever the compiled modules
run too (their functions are not seen by a profile function at all).
"""
import sys
import threading

import pytest
import torch
from mp_utils import free_port, run_workers

pytestmark = pytest.mark.timeout(180)

CALLS = 1000
# Python function calls per message (issue 27's bound; 81 and 76 before the lean path,
# 51 and 44 after it)
CALLER_MAX = 60     # the caller's side (all threads)
CALLEE_MAX = 60     # the callee's side

_COUNT = [0]


def _prof(frame, event, arg):
    if event == "call":
        _COUNT[0] += 1


def _count() -> int:
    return _COUNT[0]


def _measure(rank, world_size, calls, port):
    import distgrad.rpc as rpc
    sys.setprofile(_prof)
    threading.setprofile(_prof)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    import distgrad
    path = distgrad.info()["message_path"]
    out = None
    if rank == 0:
        x = torch.ones(4)
        for _ in range(200):   # warm: connections, caches, the pool's threads
            rpc.rpc_sync("worker1", torch.add, args=(x, 1))
        a0, b0 = _COUNT[0], rpc.rpc_sync("worker1", _count)
        for _ in range(calls):
            rpc.rpc_sync("worker1", torch.add, args=(x, 1))
        a1, b1 = _COUNT[0], rpc.rpc_sync("worker1", _count)
        out = ((a1 - a0) / calls, (b1 - b0) / calls, path)
    rpc.shutdown()
    sys.setprofile(None)
    threading.setprofile(None)
    return out


def count_calls(calls: int = CALLS, pure: bool = True) -> tuple[float, float, str]:
    """(caller, callee) Python function calls per small rpc_sync, and the message
    path that ran ("interpreted" with ``pure``)."""
    env = {"DISTGRAD_PURE": "1" if pure else "0"}
    return run_workers(_measure, world_size=2, init=False, timeout=150,
                       args=(calls, free_port()), env_per_rank={0: env, 1: env})[0]


def test_a_small_call_costs_few_python_calls_on_each_side():
    caller, callee, path = count_calls()
    assert path == "interpreted", path
    print(f"python calls per message: caller {caller:.1f}, callee {callee:.1f}")
    assert caller <= CALLER_MAX, caller
    assert callee <= CALLEE_MAX, callee


if __name__ == "__main__":
    print("interpreted:", count_calls())
    print("as installed:", count_calls(pure=False))
