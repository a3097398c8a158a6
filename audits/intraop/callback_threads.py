"""Which thread runs consecutive then-callbacks on worker0 (test_intra_op_threads's
callback assertion): if each runs on a thread that never initialized its count, the
assertion holds with or without the change.
    PYTHONPATH=<wt>:<wt>/tests DISTGRAD_PURE=1 python callback_threads.py
"""
import threading
import torch
from mp_utils import run_workers


def _prog(rank, world_size):
    import distgrad.rpc as rpc
    if rank == 1:
        return None
    out = []
    for k in range(4):
        r = rpc.rpc_async("worker1", torch.add, args=(torch.ones(1), 1)).then(
            lambda f: (threading.current_thread().name, threading.get_ident(), torch.get_num_threads())).wait()
        out.append(r)
        torch.set_num_threads(r[2] + 1)
    return out


if __name__ == "__main__":
    for _ in range(2):
        print(run_workers(_prog, world_size=2, timeout=60, options={"num_worker_threads": 4})[0], flush=True)
