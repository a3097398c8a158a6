"""c7b8149's claim: rpc_sync(w, torch.mul, ...)'s result has a recv function as grad_fn;
a post-hook on it gets grad_inputs () in torch (nothing to scale), a pre-hook scales
what is shipped; local autograd (MulBackward0) scales with both. --impl local|torch|distgrad."""
import argparse, json, os, socket, multiprocessing as mp
import torch
SECRET = "e6322fbce9c88c169fbd6b1aba3050223d9e940b978cef4791345bab9c71edef"


def case(call, dest, kind):
    x = torch.tensor([1.0, -2.0, 0.5], requires_grad=True)
    z = torch.tensor([2.0, 3.0, 4.0], requires_grad=True)
    y = call(dest, x, z)
    seen = []
    if kind == "post":
        y.grad_fn.register_hook(lambda gi, go: (seen.append(repr(gi)), tuple(None if g is None else g * 5 for g in gi))[1])
    else:
        y.grad_fn.register_prehook(lambda go: (seen.append(len(go)), tuple(g * 3 for g in go))[1])
    return x, z, y, (y * torch.tensor([1.0, 0.5, -1.0])).sum(), seen


def worker(rank, port, impl, q):
    os.environ["DISTGRAD_SECRET"] = SECRET
    if impl == "torch":
        import torch.distributed.rpc as rpc, torch.distributed.autograd as da
    else:
        import distgrad.rpc as rpc, distgrad.autograd as da
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}"))
    if rank == 0:
        res = {}
        for dest in ("worker1", "worker0"):
            for kind in ("post", "pre"):
                with da.context() as cid:
                    x, z, y, root, seen = case(lambda d, a, b: rpc.rpc_sync(d, torch.mul, args=(a, b)), dest, kind)
                    da.backward(cid, [root])
                    g = da.get_gradients(cid)
                    res[f"{dest}/{kind}"] = dict(name=y.grad_fn.name(), next=len(y.grad_fn.next_functions),
                                                 seen=seen, gx=g[x].tolist(), gz=g[z].tolist())
        q.put(json.dumps(res))
    rpc.shutdown()


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


if __name__ == "__main__":
    ap = argparse.ArgumentParser(); ap.add_argument("--impl", required=True); impl = ap.parse_args().impl
    if impl == "local":
        res = {}
        for dest in ("worker1", "worker0"):
            for kind in ("post", "pre"):
                x, z, y, root, seen = case(lambda d, a, b: torch.mul(a, b), dest, kind)
                root.backward()
                res[f"{dest}/{kind}"] = dict(name=y.grad_fn.name(), next=len(y.grad_fn.next_functions), seen=seen,
                                             gx=x.grad.tolist(), gz=z.grad.tolist())
    else:
        ctx = mp.get_context("spawn"); q = ctx.Queue(); port = free_port()
        ps = [ctx.Process(target=worker, args=(r, port, impl, q)) for r in range(2)]
        [p.start() for p in ps]; res = json.loads(q.get(timeout=120)); [p.join(30) for p in ps]
    for k, v in res.items():
        print(impl, k, json.dumps(v))
