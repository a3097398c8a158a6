"""``dist_autograd.detect_anomaly()``: a NaN or Inf born in a backward function on any
worker is reported with that worker, the node, its forward stack there, and the
workers the poisoned gradient would have travelled; off, nothing changes.

Random programs with a NaN node injected at a random place: tests/test_autograd_random.py.
"""
import time

import pytest
import torch
from mp_utils import run_workers

pytestmark = pytest.mark.timeout(120)


class Poison(torch.autograd.Function):
    """Identity whose backward returns NaN."""

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


def third_stage(h):
    """On worker2: the poisoned node is created here."""
    return torch.tanh(Poison.apply(h * 3))


def second_stage(h):
    """On worker1: passes on to worker2 (nested)."""
    import distgrad.rpc as rpc
    return rpc.rpc_sync("worker2", third_stage, args=(h.sin(),)) * 2


def _passes_left():
    import distgrad.autograd as dist_autograd
    return dist_autograd._get_debug_info()["num_current_backward_passes"]


def _report(e):
    from distgrad.errors import AnomalyError, BackwardError
    return {"type": type(e).__name__, "anomaly": isinstance(e, AnomalyError),
            "backward": isinstance(e, BackwardError), "runtime": isinstance(e, RuntimeError),
            "msg": str(e), "worker": e.worker_name, "node": e.node_name,
            "chains": getattr(e, "chains", None), "stack": getattr(e, "forward_stack", "")}


def anomaly_cases(rank, world):
    if rank != 0:
        return None
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    out = {}
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    # 1. NaN born on worker2, two hops away
    with dist_autograd.detect_anomaly():
        with dist_autograd.context() as cid:
            y = rpc.rpc_sync("worker1", second_stage, args=(w * 2,))
            try:
                dist_autograd.backward(cid, [y.sum()])
            except Exception as e:  # noqa: BLE001
                out["nan"] = _report(e)
    # 2. Inf from an ordinary op (sqrt at 0) on worker1, through backward_async
    x = torch.tensor([0.0, 1.0, 4.0], dtype=torch.float64, requires_grad=True)
    with dist_autograd.detect_anomaly(), dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", torch.sqrt, args=(x * 1,))
        try:
            dist_autograd.backward_async(cid, [y.sum()]).wait()
        except Exception as e:  # noqa: BLE001
            out["inf"] = _report(e)
    # 3. off: the same program runs through, NaN reaches the gradient
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", second_stage, args=(w * 2,))
        dist_autograd.backward(cid, [y.sum()])
        out["off_nan"] = bool(torch.isnan(dist_autograd.get_gradients(cid)[w]).all())
    # 4. anomaly mode on, nothing wrong: exact gradients, as without it
    with dist_autograd.detect_anomaly(), dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", torch.mul, args=(w, w.detach() + 1))
        dist_autograd.backward(cid, [(y ** 2).sum()])
        got = dist_autograd.get_gradients(cid)[w]
    want = 2 * w.detach() * (w.detach() + 1) ** 2
    out["clean_ok"] = bool(torch.allclose(got, want))
    # 5. nothing is left running anywhere
    deadline = time.monotonic() + 10
    while True:
        left = [rpc.rpc_sync(f"worker{r}", _passes_left) for r in range(world)]
        if not any(left) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    out["left"] = left
    out["torch_mode_after"] = torch.is_anomaly_enabled()
    return out


def test_anomaly_names_worker_node_stack_and_chain():
    out = run_workers(anomaly_cases, world_size=3, timeout=90)[0]
    nan = out["nan"]
    assert nan["anomaly"] and nan["backward"] and nan["runtime"], nan
    assert nan["worker"] == "worker2" and nan["node"] == "PoisonBackward", nan
    assert nan["msg"].startswith("Error on Node 2: Function 'PoisonBackward' returned nan values"), nan["msg"]
    assert nan["chains"] == [["worker2", "worker1", "worker0"]], nan["chains"]
    # the forward stack is worker2's, from the user's function on (distgrad's frames cut)
    assert "in third_stage" in nan["stack"] and "Poison.apply" in nan["stack"], nan["stack"]
    assert "distgrad/rpc" not in nan["stack"], nan["stack"]
    assert "third_stage" in nan["msg"]

    inf = out["inf"]
    assert inf["anomaly"] and inf["worker"] == "worker1" and inf["node"] == "SqrtBackward0", inf
    assert "returned inf values" in inf["msg"] and inf["chains"] == [["worker1", "worker0"]], inf

    assert out["off_nan"]
    assert out["clean_ok"]
    assert out["left"] == [0, 0, 0]
    assert out["torch_mode_after"] is False
