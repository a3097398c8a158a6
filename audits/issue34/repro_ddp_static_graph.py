"""DDP(static_graph=True) under a distributed autograd context, two trainers, every parameter
used, three steps (one context each).

torch: the context holds the group's average (the Reducer reads/writes the context's gradients,
Reducer::runGradCallbackForVariable; in the first iteration of a static graph the all-reduce is
delayed to the end of backward by the callback _DDPSink.backward queues, Reducer::delay_all_reduce).

Prints REPRO OK when every trainer's context holds the average of the local gradients
(computed with plain autograd and dist.all_reduce) for every parameter at every step; also prints
how far the context is from the trainer's own (unaveraged) gradient.
"""
import argparse, multiprocessing as mp, os, queue, socket, warnings
import torch
warnings.filterwarnings("ignore")


def net():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).double()


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
    rows = []
    try:
        torch.manual_seed(1)
        lin = net()
        ref = net(); ref.load_state_dict(lin.state_dict())
        model = DDP(lin, static_graph=True)
        torch.manual_seed(0)
        for step in range(3):
            x = torch.randn(3, 4, dtype=torch.float64) * (rank + 1 + step)
            local = [g.clone() for g in torch.autograd.grad(ref(x).sum(), list(ref.parameters()))]
            avg = [g.clone() for g in local]
            for a in avg:
                dist.all_reduce(a); a /= 2
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [model(x).sum()])
                got = dist_autograd.get_gradients(cid)
                rows.append([(None, None) if p not in got else
                             (float((got[p] - a).abs().max()), float((got[p] - l).abs().max()))
                             for p, a, l in zip(lin.parameters(), avg, local)])
        out.put((rank, rows))
    except BaseException as e:  # noqa: BLE001
        out.put((rank, f"{type(e).__name__}: {str(e)[:300]}"))
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
    for r, rows in sorted(results.items()):
        if isinstance(rows, str):
            bad.append(f"trainer {r}: {rows}")
            continue
        for step, row in enumerate(rows):
            print(f"[{impl}] trainer {r} step {step}: (|ctx - average|, |ctx - own local grad|) per parameter: "
                  + ", ".join(f"({a:.3g}, {l:.3g})" if a is not None else "(absent)" for a, l in row))
            if any(a is None or a > 1e-9 for a, _ in row):
                bad.append(f"trainer {r} step {step}: the context does not hold DDP's average")
    for b in bad:
        print("REPRO FAIL:", b)
    print("REPRO OK" if not bad else f"REPRO FAIL ({len(bad)})")
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
