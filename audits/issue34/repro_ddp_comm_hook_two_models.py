"""(variant: comm hook, two DDP models in one pass; see the end of this docstring)
Two backward passes through a DistributedDataParallel model in ONE distributed autograd
context (gradient accumulation), two trainers.

torch: under a distributed autograd context DDP's Reducer reads and writes the gradient the
context holds (Reducer::runGradCallbackForVariable). In the second pass the dist engine first adds
the pass's local gradient into the context's gradient in place (DistAccumulateGradCaptureHook ->
DistAutogradContext::accumulateGrad), then DDP's hook reads that sum and all-reduces it. So the
context ends with the group's average of everything accumulated, avg(l1) + avg(l2), in every case:
  plain      : two synced passes;
  no_sync    : pass 1 under ddp.no_sync() (the usual gradient-accumulation pattern), pass 2 synced:
               the context's l1 is all-reduced with pass 2's gradient -> avg(l1 + l2);
  bucket_view: DDP(gradient_as_bucket_view=True), two synced passes.

Prints REPRO OK when each trainer's context holds avg(l1) + avg(l2) for both parameters in every
case (the expected value computed with plain autograd and dist.all_reduce).
"""
import argparse, multiprocessing as mp, os, queue, socket, warnings
import torch
CASES = ("comm_hook", "two_models")
warnings.filterwarnings("ignore")


def worker(rank, ports, impl, out):
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
        x1 = torch.randn(3, 4, dtype=torch.float64) * (rank + 1)
        x2 = torch.randn(3, 4, dtype=torch.float64) * (rank + 2)
        for case in CASES:
            torch.manual_seed(1)
            lin = torch.nn.Linear(4, 4).double()
            # expected: avg(l1) + avg(l2), local gradients by plain autograd
            ref = torch.nn.Linear(4, 4).double()
            ref.load_state_dict(lin.state_dict())
            want = []
            for p in ref.parameters():
                want.append(torch.zeros_like(p))
            for x in (x1, x2):
                gs = torch.autograd.grad((ref(x) ** 2).sum(), list(ref.parameters()))
                for w, g in zip(want, gs):
                    w += g
            for w in want:
                dist.all_reduce(w)
                w /= 2
            model = DDP(lin, gradient_as_bucket_view=(case == "bucket_view"))
            if case == "comm_hook":
                def hook(state, bucket):
                    buf = bucket.buffer().div_(2)
                    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])
                model.register_comm_hook(None, hook)
            if case == "two_models":
                torch.manual_seed(1)
                lin2 = torch.nn.Linear(4, 4).double()
                model2 = DDP(lin2)
                ref2 = torch.nn.Linear(4, 4).double(); ref2.load_state_dict(lin2.state_dict())
                want2 = [torch.zeros_like(p) for p in ref2.parameters()]
                for x in (x1, x2):
                    gs = torch.autograd.grad((ref2(x) ** 3).sum(), list(ref2.parameters()))
                    for w, g in zip(want2, gs):
                        w += g
                for w in want2:
                    dist.all_reduce(w); w /= 2
                fwd = lambda x: (model(x) ** 2).sum() + (model2(x) ** 3).sum()
            else:
                fwd = lambda x: (model(x) ** 2).sum()
            with dist_autograd.context() as cid:
                if case == "no_sync":
                    with model.no_sync():
                        dist_autograd.backward(cid, [fwd(x1)])
                else:
                    dist_autograd.backward(cid, [fwd(x1)])
                dist_autograd.backward(cid, [fwd(x2)])
                got = dist_autograd.get_gradients(cid)
                errs = [float((got[p] - w).abs().max()) if p in got else None
                        for p, w in zip(lin.parameters(), want)]
                if case == "two_models":
                    errs += [float((got[p] - w).abs().max()) if p in got else None
                             for p, w in zip(lin2.parameters(), want2)]
            res[case] = errs
            dist.barrier()
        out.put((rank, res))
    except BaseException as e:  # noqa: BLE001
        out.put((rank, {"error": f"{type(e).__name__}: {str(e)[:300]}"}))
    finally:
        rpc.shutdown()
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("torch", "distgrad"), default="distgrad")
    impl = ap.parse_args().impl
    ports = []
    for _ in range(2):
        s = socket.socket(); s.bind(("127.0.0.1", 0)); ports.append(s.getsockname()[1]); s.close()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, ports, impl, out)) for r in range(2)]
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
    bad = []
    if len(results) < 2:
        bad.append("no result from every trainer within 150 s")
    for r, res in sorted(results.items()):
        if "error" in res:
            bad.append(f"trainer {r}: {res['error']}")
            continue
        for case, errs in res.items():
            print(f"[{impl}] trainer {r} {case}: max |context - (avg(l1)+avg(l2))| per parameter: {errs}")
            if any(e is None or e > 1e-9 for e in errs):
                bad.append(f"trainer {r}, {case}: the context does not hold avg(l1)+avg(l2): {errs}")
    for b in bad:
        print("REPRO FAIL:", b)
    print("REPRO OK" if not bad else f"REPRO FAIL ({len(bad)})")
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
