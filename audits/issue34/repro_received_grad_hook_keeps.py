"""A leaf on worker1 whose gradient arrives from worker0 (the network), with tensor hooks that keep
the gradient they see (W1: keeps its input; W2: returns a new tensor and keeps it). Two passes in
one context. torch: a gradient someone else holds is cloned before it is stored (use count rule in
AccumulateGrad::accumulateGrad), so pass 2's in-place add never reaches what the hooks kept.

REPRO OK when the kept tensors still hold pass 1's values and the context holds the sums
(meant to be checked on `--impl torch`).

Audit result: torch 2.13 does NOT pass this: pass 1 completes, then the second forward RPC to
worker1 times out after 60 s (even with only W1's keeping hook), so there is no torch reference;
distgrad prints REPRO OK (the kept tensors are copied, the sums right). Not a distgrad defect.
"""
import argparse, multiprocessing as mp, os, queue, socket, warnings
import torch
warnings.filterwarnings("ignore")
S = {}


def setup():
    S["w1"] = torch.ones(3, requires_grad=True)
    S["w2"] = torch.ones(3, requires_grad=True)
    S["k1"], S["k2"] = [], []
    S["w1"].register_hook(lambda g: S["k1"].append(g))

    def h2(g):
        t = g * 2
        S["k2"].append(t)
        return t
    S["w2"].register_hook(h2)


def fwd(x):
    return x * S["w1"] + x * S["w2"]


def check(cid):
    import importlib, os
    da = importlib.import_module("torch.distributed.autograd" if os.environ["REPRO_IMPL"] == "torch"
                                 else "distgrad.autograd")
    g = da.get_gradients(cid)
    return ([t.tolist() for t in S["k1"]], [t.tolist() for t in S["k2"]],
            g[S["w1"]].tolist(), g[S["w2"]].tolist())


def worker(rank, port, impl, out):
    os.environ["REPRO_IMPL"] = impl
    os.environ.setdefault("DISTGRAD_SECRET", "e6322fbce9c88c169fbd6b1aba3050223d9e940b978cef4791345bab9c71edef")
    if impl == "torch":
        import torch.distributed.rpc as rpc
        import torch.distributed.autograd as da
    else:
        import distgrad.rpc as rpc
        import distgrad.autograd as da
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}"))
    if rank == 0:
        bad = []
        try:
            rpc.rpc_sync("worker1", setup)
            x = torch.full((3,), 3.0, requires_grad=True)
            with da.context() as cid:
                da.backward(cid, [rpc.rpc_sync("worker1", fwd, args=(x,)).sum()])
                da.backward(cid, [(rpc.rpc_sync("worker1", fwd, args=(x,)) * 5).sum()])
                k1, k2, g1, g2 = rpc.rpc_sync("worker1", check, args=(cid,))
            if k1 != [[3.0] * 3, [15.0] * 3]:
                bad.append(f"W1's hook kept {k1} (torch: [[3]*3, [15]*3])")
            if k2 != [[6.0] * 3, [30.0] * 3]:
                bad.append(f"W2's hook kept {k2} (torch: [[6]*3, [30]*3])")
            if g1 != [18.0] * 3 or g2 != [36.0] * 3:
                bad.append(f"context: W1 {g1} W2 {g2} (torch: 18s, 36s)")
        except BaseException as e:  # noqa: BLE001
            bad.append(f"{type(e).__name__}: {e}")
        out.put(bad)
    rpc.shutdown()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("torch", "distgrad"), default="distgrad")
    impl = ap.parse_args().impl
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, port, impl, out)) for r in range(2)]
    for p in ps:
        p.start()
    try:
        bad = out.get(timeout=120)
    except queue.Empty:
        bad = ["no result within 120 s"]
    for p in ps:
        p.join(30)
        if p.is_alive():
            p.kill()
    for b in bad:
        print(f"[{impl}] REPRO FAIL:", b)
    print("REPRO OK" if not bad else f"REPRO FAIL ({len(bad)})")
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
