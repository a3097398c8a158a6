"""Compare, per case, the leaves' gradients after a kept gradient is mutated:
--impl local (plain autograd, calls as function calls: what random_programs' reference
does), --impl torch (torch.distributed.autograd, world 2), --impl distgrad.
Where: 'here' (op on worker0 inside the context), 'w1' (rpc_sync to worker1), 'self'
(rpc_sync to worker0). retain: backward twice (retain_graph) in one context / .grad."""
import argparse, json, os, sys, multiprocessing as mp, socket
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import alias_cases as C

SECRET = "e6322fbce9c88c169fbd6b1aba3050223d9e940b978cef4791345bab9c71edef"
WHERES = ("here", "w1", "self")


def leaves(op):
    if "embedding" in op:
        return C._w((2, 3)).requires_grad_(), C._w((2, 3)).neg().requires_grad_()
    return C._w((2, 3)).requires_grad_(), (C._w((2, 3)) + 1).requires_grad_()


def dense(g):
    if g is None:
        return None
    return g.to_dense().tolist() if g.is_sparse else g.tolist()


def run_local():
    res = {}
    for op in C.OPS:
        for retain in (False, True):
            a, b = leaves(op)
            root = getattr(C, op)(a, b)
            root.backward(retain_graph=retain)
            if retain:
                root.backward()
            before = [dense(a.grad), dense(b.grad)]
            C.mutate_here()
            after = [dense(a.grad), dense(b.grad)]
            for where in WHERES:   # the reference runs every call as a function call
                res[f"{op}/{where}/retain={retain}"] = {"after": after, "changed": after != before}
    return res


def worker(rank, port, impl, q):
    os.environ["DISTGRAD_SECRET"] = SECRET
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    if impl == "torch":
        import torch.distributed.rpc as rpc
        import torch.distributed.autograd as dist_autograd
    else:
        import distgrad.rpc as rpc
        import distgrad.autograd as dist_autograd
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=8)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    try:
        if rank == 0:
            res = {}
            for op in C.OPS:
                for where in WHERES:
                    for retain in (False, True):
                        key = f"{op}/{where}/retain={retain}"
                        try:
                            a, b = leaves(op)
                            with dist_autograd.context() as cid:
                                f = getattr(C, op)
                                if where == "here":
                                    root = f(a, b)
                                else:
                                    root = rpc.rpc_sync("worker1" if where == "w1" else "worker0", f, args=(a, b))
                                dist_autograd.backward(cid, [root], retain_graph=retain)
                                if retain:
                                    dist_autograd.backward(cid, [root])
                                gs = dist_autograd.get_gradients(cid)
                                before = [dense(gs.get(a)), dense(gs.get(b))]
                                C.mutate_here()
                                rpc.rpc_sync("worker1", C.mutate_here)
                                gs = dist_autograd.get_gradients(cid)
                                after = [dense(gs.get(a)), dense(gs.get(b))]
                                res[key] = {"after": after, "changed": after != before}
                        except Exception as e:  # noqa
                            res[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
            q.put(json.dumps(res))
    except BaseException as e:
        q.put(json.dumps({"error": repr(e)}))
    rpc.shutdown()


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("local", "torch", "distgrad"), required=True)
    ap.add_argument("--out", required=True)
    impl = ap.parse_args().impl
    if impl == "local":
        res = run_local()
    else:
        ctx = mp.get_context("spawn"); q = ctx.Queue(); port = free_port()
        ps = [ctx.Process(target=worker, args=(r, port, impl, q)) for r in range(2)]
        for p in ps: p.start()
        res = json.loads(q.get(timeout=300))
        for p in ps: p.join(60)
    json.dump(res, open(ap.parse_args().out, "w"), indent=0, sort_keys=True)
    print(impl, "cases:", len(res))
