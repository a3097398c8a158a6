"""DDP(find_unused_parameters=True) under a distributed autograd context, a layer unused on ONE
trainer only (rank 1 skips layer b), plus variants: b unused on both trainers; static_graph=True.

Prints, per trainer and case, what get_gradients holds for each DDP parameter, and compares with
the expected values (derived from torch's Reducer under dist autograd): a parameter used on some
trainer gets the group's average on every trainer where it has a gradient entry.

Prints REPRO OK when distgrad's contexts hold what torch's hold (the check is the set of
parameters present and their values against avg of the local gradients, 0 for a trainer that did
not use it).
"""
import argparse, multiprocessing as mp, os, queue, socket, warnings
import torch
warnings.filterwarnings("ignore")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4).double()
        self.b = torch.nn.Linear(4, 4).double()

    def forward(self, x, use_b):
        y = self.a(x)
        return self.b(y) if use_b else y


def worker(rank, ports, impl, out, cases):
    os.environ.setdefault("DISTGRAD_SECRET", "e6322fbce9c88c169fbd6b1aba3050223d9e940b978cef4791345bab9c71edef")
    if impl == "torch":
        import torch.distributed.rpc as rpc
        import torch.distributed.autograd as dist_autograd
    else:
        import distgrad.rpc as rpc
        import distgrad.autograd as dist_autograd
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=2)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{ports[1]}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    res = {}
    try:
        torch.manual_seed(0)
        xs = [torch.randn(3, 4, dtype=torch.float64) * (rank + 1 + i) for i in range(3)]
        for case in cases:
            torch.manual_seed(1)
            net = Net()
            ref = Net(); ref.load_state_dict(net.state_dict())
            use_b = {"one_rank": rank == 0, "both": False, "static_one_rank": rank == 0, "static_used": True, "static_used_2ctx_steps": True}[case]
            kw = {"static_graph": True} if case.startswith("static") else {"find_unused_parameters": True}
            model = DDP(net, **kw)
            names = [n for n, _ in net.named_parameters()]
            steps = []
            for x in xs:
                # expected: per parameter, all-reduced local gradient / 2 (0 where unused)
                loss = ref(x, use_b).sum()
                gs = torch.autograd.grad(loss, list(ref.parameters()), allow_unused=True)
                want = []
                for p, g in zip(ref.parameters(), gs):
                    w = torch.zeros_like(p) if g is None else g.clone()
                    dist.all_reduce(w); w /= 2
                    want.append(w)
                with dist_autograd.context() as cid:
                    dist_autograd.backward(cid, [model(x, use_b).sum()])
                    got = dist_autograd.get_gradients(cid)
                    row = {}
                    for n, p, w in zip(names, net.parameters(), want):
                        row[n] = None if p not in got else float((got[p] - w).abs().max())
                    steps.append(row)
            res[case] = steps
            dist.barrier()
        out.put((rank, res))
    except BaseException as e:  # noqa: BLE001
        import traceback; traceback.print_exc()
        out.put((rank, {"error": f"{type(e).__name__}: {str(e)[:300]}"}))
    finally:
        rpc.shutdown()
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("torch", "distgrad"), default="distgrad")
    ap.add_argument("--cases", default="one_rank,both,static_one_rank")
    a = ap.parse_args()
    impl, cases = a.impl, a.cases.split(",")
    ports = []
    for _ in range(2):
        s = socket.socket(); s.bind(("127.0.0.1", 0)); ports.append(s.getsockname()[1]); s.close()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, ports, impl, out, cases)) for r in range(2)]
    for p in ps:
        p.start()
    results = {}
    try:
        for _ in range(2):
            r, res = out.get(timeout=150)
            results[r] = res
    except queue.Empty:
        pass
    for p in ps:
        p.join(30)
        if p.is_alive():
            p.kill()
    for r, res in sorted(results.items()):
        for case, steps in res.items():
            print(f"[{impl}] trainer {r} {case}: {steps}")
    print("RESULT", sorted(results.items()))


if __name__ == "__main__":
    raise SystemExit(main())
