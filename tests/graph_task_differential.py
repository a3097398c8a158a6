"""What torch ties to one graph task per worker per pass (issue 43), run on torch's RPC
and distributed autograd and on distgrad's, each in processes of its own (the torch
run never imports distgrad): every observation must be equal.

    python tests/graph_task_differential.py --impl torch      # prints one JSON line
    python tests/graph_task_differential.py --impl distgrad

What worker0 records, on two workers:
  - register_multi_grad_hook over a local half and an RPC half ("all" and "any"):
    calls, which gradients each call got;
  - a final callback queued by a hook (queue_callback): when it runs among the hooks,
    which gradients the context holds then;
  - a TorchDispatchMode around backward: whether it sees the op of a node that runs
    after the gradient came back over RPC;
  - inside a hook: whether a context is current, and whether one can be opened;
  - a second backward without retain_graph, sent only and used locally and sent:
    whether it raises "backward through the graph a second time";
  - gradients a hook kept, changed in place after the pass: whether the context's
    gradient follows (stack's two views; a sum of a local use and an RPC arrival);
  - the send and recv functions' names, next functions and input counts;
  - a distributed backward started inside a local backward's hook;
  - a plain leaf sent while another thread runs ops on it (finishes).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing as mp
import os
import queue
import sys
import threading
import time

import torch
from mp_utils import free_port, reap  # no distgrad: mp_utils imports it only inside workers

SECRET = "e6322fbce9c88c169fbd6b1aba3050223d9e940b978cef4791345bab9c71edef"


def _modules(impl: str):
    if impl == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
    else:
        import distgrad.autograd as dist_autograd
        import distgrad.rpc as rpc
    return rpc, dist_autograd


def ident(t):
    return t


def _has(grads, *ts) -> list:
    return [t in grads for t in ts]


def _multi_grad(rpc, dist_autograd) -> dict:
    out = {}
    for mode in ("all", "any"):
        x1 = torch.ones(3, requires_grad=True)
        x2 = torch.ones(3, requires_grad=True)
        calls = []
        with dist_autograd.context() as cid:
            a = x1 * 2
            b = x2 * 3
            def fn(gs, calls=calls):
                if isinstance(gs, (list, tuple)):
                    calls.append([None if g is None else g.tolist() for g in gs])
                else:
                    calls.append(gs.tolist())
            torch.autograd.graph.register_multi_grad_hook((a, b), fn, mode=mode)
            loss = a.sum() + rpc.rpc_sync("worker1", ident, args=(b,)).sum()
            dist_autograd.backward(cid, [loss])
            g = dist_autograd.get_gradients(cid)
            out[mode] = {"calls": len(calls), "first": calls[0] if calls else None,
                         "x1": g[x1].tolist(), "x2": g[x2].tolist()}
    return out


def _final_callback(rpc, dist_autograd) -> list:
    x1 = torch.ones(3, requires_grad=True)
    x2 = torch.ones(3, requires_grad=True)
    events = []
    with dist_autograd.context() as cid:
        def final():
            g = dist_autograd.get_gradients(cid)
            events.append(["callback", _has(g, x1, x2)])

        def hook_a(grad):
            events.append("hook a")
            torch.autograd.Variable._execution_engine.queue_callback(final)
        a = x1 * 2
        b = x2 * 3
        a.register_hook(hook_a)
        b.register_hook(lambda grad: events.append("hook b"))
        loss = a.sum() + rpc.rpc_sync("worker1", ident, args=(b,)).sum()
        dist_autograd.backward(cid, [loss])
    # hooks a and b run in an order that depends on how fast the gradient comes back
    # under torch; the callback must come after both and see both gradients
    return [sorted(e for e in events if isinstance(e, str)), events[-1]]


def _dispatch_mode(rpc, dist_autograd) -> list:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func))
            return func(*args, **(kwargs or {}))
    x = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64, requires_grad=True)
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", ident, args=(x * 3,))
        loss = torch.sin(x + y).sum()   # worker0's own node, then the RPC hop, then mul
        with torch.no_grad(), Recorder() as mode:
            dist_autograd.backward(cid, [loss])
        g = dist_autograd.get_gradients(cid)[x]
    return [sorted(o for o in mode.ops if o in ("aten.cos.default", "aten.mul.Tensor")),
            [round(v, 6) for v in g.tolist()]]


def _note_current(dist_autograd, seen: list) -> None:
    """Record whether a distributed autograd context is current on this thread."""
    try:
        dist_autograd._current_context()
        seen.append("current")
    except RuntimeError:
        seen.append("none current")


def _hook_context(rpc, dist_autograd) -> list:
    seen = []
    x = torch.ones(2, requires_grad=True)

    def hook(g):
        _note_current(dist_autograd, seen)
        try:
            with dist_autograd.context():
                seen.append("opened")
        except RuntimeError as e:
            seen.append("open failed: " + str(e)[:60])
    with dist_autograd.context() as cid:
        y = x * 2
        y.register_hook(hook)
        loss = rpc.rpc_sync("worker1", ident, args=(y,)).sum()
        dist_autograd.backward(cid, [loss])
    return seen


def _second_pass(rpc, dist_autograd) -> dict:
    out = {}
    for case in ("sent", "shared"):
        x = torch.linspace(0, 1, 4, requires_grad=True)
        with dist_autograd.context() as cid:
            h = x.exp()
            loss = rpc.rpc_sync("worker1", ident, args=(h,)).sum()
            if case == "shared":
                loss = loss + h.sum()
            dist_autograd.backward(cid, [loss])
            g1 = dist_autograd.get_gradients(cid)[x].clone()
            try:
                dist_autograd.backward(cid, [loss])
                second = "ran"
            except RuntimeError as e:
                second = "second time" if "second time" in str(e) else "other error"
            g2 = dist_autograd.get_gradients(cid)[x]
        out[case] = [second, torch.equal(g1, g2)]
    return out


def _kept_views(rpc, dist_autograd) -> dict:
    out = {}
    w = torch.tensor([1.0, 2.0, 3.0])
    for how in ("stack", "cat"):
        x1 = torch.ones(3, requires_grad=True)
        x2 = torch.ones(3, requires_grad=True)
        kept = []
        with dist_autograd.context() as cid:
            s = torch.stack([x1, x2]) if how == "stack" else torch.cat([x1, x2])
            s.register_hook(lambda g, kept=kept: kept.append(g))
            loss = (rpc.rpc_sync("worker1", ident, args=(s,)) * w.repeat(2 if how == "cat" else 1)).sum()
            dist_autograd.backward(cid, [loss])
            before = [dist_autograd.get_gradients(cid)[t].clone() for t in (x1, x2)]
            with torch.no_grad():
                kept[0].add_(1)
            after = [dist_autograd.get_gradients(cid)[t] for t in (x1, x2)]
            out[how] = [not torch.equal(b, a) for b, a in zip(before, after)]
    for use_local in (True, False):
        x = (torch.arange(9.).reshape(3, 3) / 7).requires_grad_()
        y = x.reshape(3, 3)
        kept = []
        y.register_hook(lambda g, kept=kept: kept.append(g))
        with dist_autograd.context() as cid:
            root = (rpc.rpc_sync("worker1", ident, args=(y,)) * 2).sum()
            if use_local:
                root = root + (y * 3).sum()
            dist_autograd.backward(cid, [root])
            before = dist_autograd.get_gradients(cid)[x].clone()
            with torch.no_grad():
                for g in kept:
                    g.add_(1)
            out[f"sum local={use_local}"] = not torch.equal(before, dist_autograd.get_gradients(cid)[x])
    return out


def _nodes(rpc, dist_autograd) -> dict:
    x = torch.ones(2, requires_grad=True)
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", torch.add, args=(x * 1, x))
        ctx = dist_autograd._retrieve_context(cid)
        send = list(ctx._send_functions().values())[0]
        recv = list(ctx._recv_functions().values())[0]
        return {"recv": [y.grad_fn.name(), list(y.grad_fn.next_functions), recv.name()],
                "send": [send.name(), [type(n).__name__ for n, _ in send.next_functions],
                         len(send._input_metadata)],
                "send_type": type(send).__name__, "recv_type": type(recv).__name__}


def _inside_hook(rpc, dist_autograd) -> list:
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    got = []

    def hook(g):
        with dist_autograd.context() as cid, torch.enable_grad():
            loss = rpc.rpc_sync("worker1", ident, args=(w * 3,)).sum()
            dist_autograd.backward(cid, [loss])
            got.append(dist_autograd.get_gradients(cid)[w].tolist())
        return g
    z = torch.ones(2, requires_grad=True)
    out = z * 5
    out.register_hook(hook)
    out.sum().backward()
    return [got, z.grad.tolist()]


def _leaf_sent_while_used(rpc, dist_autograd) -> bool:
    x = torch.ones(16, requires_grad=True)
    stop = threading.Event()

    def op_loop():
        while not stop.is_set():
            y = x * 2
            del y
    t = threading.Thread(target=op_loop, daemon=True)
    t.start()
    try:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            with dist_autograd.context():
                rpc.rpc_sync("worker1", ident, args=(x,))
    finally:
        stop.set()
        t.join(10)
    return True


def _final_callback_error(rpc, dist_autograd) -> list:
    x = torch.ones(2, requires_grad=True)

    def boom():
        raise ValueError("boom")
    with dist_autograd.context() as cid:
        y = x * 2
        y.register_hook(lambda g: torch.autograd.Variable._execution_engine.queue_callback(boom))
        loss = rpc.rpc_sync("worker1", ident, args=(y,)).sum()
        try:
            dist_autograd.backward(cid, [loss])
            return ["returned"]
        except RuntimeError as e:
            return ["raised", "boom" in str(e)]


def _acc_hook_context(rpc, dist_autograd) -> list:
    seen = []
    w = torch.ones(2, requires_grad=True)

    def pre(grads):
        _note_current(dist_autograd, seen)
    with dist_autograd.context() as cid:
        y = w * 3
        torch.autograd.graph.get_gradient_edge(w).node.register_prehook(pre)
        loss = rpc.rpc_sync("worker1", ident, args=(y,)).sum()
        dist_autograd.backward(cid, [loss])
        seen.append(dist_autograd.get_gradients(cid)[w].tolist())
    return seen


_CID = [None]


def _set_cid(cid) -> None:
    _CID[0] = cid


def _release_in_hook(t):
    u = t * 3
    u.register_hook(lambda g: _modules(_IMPL[0])[1]._release_context(_CID[0]))
    return u


def _released_mid_pass(rpc, dist_autograd) -> str:
    """worker1's hook releases the pass's context (the release spreads to worker0):
    backward fails, naming the missing context."""
    x = torch.ones(2, requires_grad=True)
    out = "?"
    try:
        with dist_autograd.context() as cid:
            rpc.rpc_sync("worker1", _set_cid, args=(cid,))
            z = rpc.rpc_sync("worker1", _release_in_hook, args=(x * 2,))
            try:
                dist_autograd.backward(cid, [z.sum()])
                out = "returned"
            except RuntimeError as e:
                found = "Could not find autograd context" in str(e)
                out = "raised" + (" (context not found)" if found else "")
    except RuntimeError:
        pass   # the with-block's exit raises too: the context is gone
    return out


CASES = [("final_callback_error", _final_callback_error), ("acc_hook_context", _acc_hook_context),
         ("multi_grad", _multi_grad), ("final_callback", _final_callback),
         ("dispatch_mode", _dispatch_mode), ("hook_context", _hook_context),
         ("second_pass", _second_pass), ("kept_views", _kept_views), ("nodes", _nodes),
         ("inside_hook", _inside_hook), ("leaf_sent_while_used", _leaf_sent_while_used),
         ("released_mid_pass", _released_mid_pass)]
_IMPL = ["torch"]   # which implementation this worker runs


def _worker(rank: int, port: int, impl: str, out, timeout: float) -> None:
    # a hang shows where every thread of both workers stood (the test prints stderr)
    faulthandler.dump_traceback_later(max(timeout - 10.0, 1.0), exit=False)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    os.environ.setdefault("DISTGRAD_SECRET", SECRET)
    _IMPL[0] = impl
    rpc, dist_autograd = _modules(impl)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        res = {}
        if impl == "distgrad":   # these are the native engine's semantics: never fall back unseen
            from distgrad.autograd import native, native_pass
            if native_pass.M is None:
                res["error"] = f"the native engine did not load: {native.WHY_NOT}"
        only = os.environ.get("GRAPH_TASK_CASES")   # (debugging: a comma-separated subset)
        for name, fn in CASES:
            if only and name not in only.split(","):
                continue
            print(f"worker0: case {name}", file=sys.stderr, flush=True)
            try:
                res[name] = fn(rpc, dist_autograd)
            except BaseException as e:  # noqa: BLE001 - recorded: it must match too
                res[name] = f"error {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        out.put(res)
    rpc.shutdown()


def run(impl: str, timeout: float = 150.0) -> dict:
    """The cases on two spawned workers of ``impl``; worker0's record."""
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(r, port, impl, out, timeout), daemon=True) for r in range(2)]
    for p in ps:
        p.start()
    try:
        res = out.get(timeout=timeout)
    except queue.Empty:
        res = {"error": f"no result in {timeout} s", "hung": True}
    reap(ps)
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("torch", "distgrad"), required=True)
    print(json.dumps(run(ap.parse_args().impl), sort_keys=True))
