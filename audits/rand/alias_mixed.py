"""Seed 7200334/w2 (default,keep_grad=0.9) in small: a hook keeps the gradient g of
y = x.reshape(3, 3) (a view; its backward hands a view of g to leaf x); y's gradient
comes from a local use and/or from y sent over RPC (returned by an identity call, to
worker1 or to worker0 itself). After backward g.add_(1). --impl local|torch|distgrad."""
import argparse, json, os, sys, socket, multiprocessing as mp
import torch

SECRET = "e6322fbce9c88c169fbd6b1aba3050223d9e940b978cef4791345bab9c71edef"
KEPT = []


def ident(t):
    return t


def send_only(t):          # uses t on the callee, returns a new result
    return t * 2


def mutate():
    with torch.no_grad():
        for g in KEPT:
            g.add_(1)
    KEPT.clear()


W1 = torch.arange(9.).reshape(3, 3) / 5
W2 = torch.arange(9.).reshape(3, 3).flip(0) / 3
CASES = [(use_local, via, dest) for use_local in (True, False) for via in ("ident", "send_only")
         for dest in ("worker1", "worker0", "local")]


def case(call, use_local, via, dest):
    x = (torch.arange(9.).reshape(3, 3) / 7).requires_grad_()
    y = x.reshape(3, 3)
    y.register_hook(lambda g: KEPT.append(g))
    f = ident if via == "ident" else send_only
    r = call(dest, f, y)
    root = (r * W2).sum()
    if use_local:
        root = root + (y * W1).sum()
    return x, root


def worker(rank, port, impl, q):
    os.environ["DISTGRAD_SECRET"] = SECRET
    torch.set_num_threads(1)
    if impl == "torch":
        import torch.distributed.rpc as rpc, torch.distributed.autograd as da
    else:
        import distgrad.rpc as rpc, distgrad.autograd as da
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}"))
    if rank == 0:
        res = {}
        for use_local, via, dest in CASES:
            with da.context() as cid:
                x, root = case(lambda d, f, t: f(t) if d == "local" else rpc.rpc_sync(d, f, args=(t,)),
                               use_local, via, dest)
                da.backward(cid, [root])
                before = da.get_gradients(cid)[x].tolist()
                mutate()
                rpc.rpc_sync("worker1", mutate)
                after = da.get_gradients(cid)[x].tolist()
                res[f"local_use={use_local} {via} to {dest}"] = {"changed": before != after, "after": after}
        q.put(json.dumps(res))
    rpc.shutdown()


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


if __name__ == "__main__":
    ap = argparse.ArgumentParser(); ap.add_argument("--impl", required=True)
    impl = ap.parse_args().impl
    if impl == "local":
        res = {}
        for use_local, via, dest in CASES:
            x, root = case(lambda d, f, t: f(t), use_local, via, dest)
            root.backward()
            before = x.grad.tolist(); mutate(); after = x.grad.tolist()
            res[f"local_use={use_local} {via} to {dest}"] = {"changed": before != after, "after": after}
    else:
        ctx = mp.get_context("spawn"); q = ctx.Queue(); port = free_port()
        ps = [ctx.Process(target=worker, args=(r, port, impl, q)) for r in range(2)]
        [p.start() for p in ps]; res = json.loads(q.get(timeout=120)); [p.join(30) for p in ps]
    for k, v in res.items():
        print(f"{impl:8s} {k:40s} changed={v['changed']} x.grad[0]={[round(a, 4) for a in v['after'][0]]}")
