"""Error paths against torch: the same program on torch.distributed.rpc and on distgrad
must raise exceptions that the same ``except`` clauses catch (distgrad's may be more
specific, never less), and distgrad's name the worker where one is concerned."""
import threading
import time

import pytest
import torch
from mp_utils import free_port, run_workers

pytestmark = pytest.mark.timeout(150)


def raise_value_error():
    raise ValueError("bad value here")


def return_lock():
    return threading.Lock()


def slow():
    time.sleep(2)
    return 1


def _cases(rpc, dist_autograd):
    """(case, callable) pairs; each callable raises, but for the last few: torch
    succeeds there, and distgrad must too."""
    return [
        ("unpicklable argument", lambda: rpc.rpc_sync("worker1", print, args=(threading.Lock(),))),
        ("local function argument", lambda: rpc.rpc_sync("worker1", print, args=(lambda x: x,))),
        ("unpicklable argument (rpc_async)",
         lambda: rpc.rpc_async("worker1", print, args=(threading.Lock(),)).wait()),
        ("unpicklable argument (remote)", lambda: rpc.remote("worker1", print, args=(threading.Lock(),))),
        ("remote ValueError", lambda: rpc.rpc_sync("worker1", raise_value_error)),
        ("remote ValueError (remote().to_here)", lambda: rpc.remote("worker1", raise_value_error).to_here()),
        ("unpicklable result", lambda: rpc.rpc_sync("worker1", return_lock)),
        ("unknown worker", lambda: rpc.rpc_sync("nobody", print)),
        ("unknown worker info", lambda: rpc.get_worker_info("nobody")),
        ("timeout", lambda: rpc.rpc_sync("worker1", slow, timeout=0.3)),
        ("backward in an unknown context", lambda: dist_autograd.backward(12345, [torch.ones(1)])),
        ("gradients of an unknown context", lambda: dist_autograd.get_gradients(12345)),
        ("root without grad", lambda: _backward_no_grad(dist_autograd)),
        # these succeed in torch
        ("builtin with a tensor", lambda: rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))),
        ("own worker info", lambda: rpc.get_worker_info()),
        ("remote() and to_here", lambda: rpc.remote("worker1", len, args=([1, 2],)).to_here()),
        ("gradients of a fresh context", lambda: _fresh_context_gradients(dist_autograd)),
    ]


def _fresh_context_gradients(dist_autograd):
    with dist_autograd.context() as cid:
        return dist_autograd.get_gradients(cid)


def _backward_no_grad(dist_autograd):
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [torch.ones(1)])


def _collect(rank, world, impl, port):
    if impl == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    else:
        import distgrad.autograd as dist_autograd
        import distgrad.rpc as rpc
    out = {}
    if rank == 0:
        for name, fn in _cases(rpc, dist_autograd):
            try:
                fn()
                out[name] = None
            except Exception as e:  # noqa: BLE001
                out[name] = ([f"{c.__module__}.{c.__qualname__}" for c in type(e).__mro__], str(e)[:300],
                             getattr(e, "worker_name", None))
    if impl == "torch":
        rpc.shutdown()
    return out


def test_error_types_match_torch():
    torch_out = run_workers(_collect, world_size=2, init=False, timeout=90,
                            args=("torch", free_port()))[0]
    ours = run_workers(_collect, world_size=2, timeout=90, args=("distgrad", 0))[0]
    assert sum(v is not None for v in torch_out.values()) >= 12, torch_out  # torch raises: a real spec
    assert sum(v is None for v in torch_out.values()) >= 4, torch_out  # and succeeds: the other side
    problems = []
    for case, want in torch_out.items():
        got = ours[case]
        if want is None:
            if got is not None:  # torch succeeds here: so must distgrad
                problems.append(f"{case}: torch does not raise, distgrad raises {got[0][0]} ({got[1]!r})")
            continue
        if got is None:
            problems.append(f"{case}: torch raises {want[0][0]}, distgrad does not raise")
            continue
        if want[0][0] not in got[0]:
            problems.append(f"{case}: torch raises {want[0][0]} ({want[1]!r}); distgrad's "
                            f"{got[0][0]} is not one ({got[0]})")
    assert not problems, "\n".join(problems)
    # ours name the worker where one is concerned
    for case in ("unpicklable argument", "local function argument", "unpicklable result", "timeout"):
        assert ours[case][2] == "worker1" or "worker1" in ours[case][1], (case, ours[case])
    # torch's exact types where users catch them
    assert "builtins.TypeError" in ours["unpicklable argument"][0]
    assert "builtins.AttributeError" in ours["local function argument"][0]
    assert "distgrad.errors.SerializationError" in ours["unpicklable argument"][0]
    assert "builtins.ValueError" in ours["remote ValueError"][0]
