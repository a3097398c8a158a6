"""shutdown(graceful=False) on a worker after rank 0 (the store's host) has already exited must
print no C++ stack trace (issue 34 item 5's rule: nothing may touch the store after rank 0 may be
gone).

distgrad: rpc/lifecycle.py finalize_shutdown calls _leave_ledger -> _uncount ->
mixing.count_out(store, ...) for a shutdown without the barrier (graceful=False); rank 0 shut down
non-gracefully and exited 1 s earlier, so the TCPStore client fails and prints its C++ trace.

Prints REPRO OK when worker1's stderr has no "frame #" / "recvVector" / "TCPStore" lines in any of
3 rounds (torch's shutdown(graceful=False) touches no store: `--impl torch`).
"""
import argparse, multiprocessing as mp, os, socket, sys, time, warnings
warnings.filterwarnings("ignore")


def worker(rank, port, impl, errfile):
    fd = os.open(errfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    os.environ.setdefault("DISTGRAD_SECRET", "e6322fbce9c88c169fbd6b1aba3050223d9e940b978cef4791345bab9c71edef")
    if impl == "torch":
        import torch.distributed.rpc as rpc
    else:
        import distgrad.rpc as rpc
    import torch
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    rpc.rpc_sync(f"worker{1 - rank}", torch.add, args=(torch.ones(1), 1))
    if rank == 1:
        time.sleep(1.5)  # rank 0 is gone by now
    rpc.shutdown(graceful=False)
    sys.stderr.flush()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("torch", "distgrad"), default="distgrad")
    impl = ap.parse_args().impl
    bad = []
    for rnd in range(3):
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        ctx = mp.get_context("spawn")
        errs = [f"/tmp/ngs_{os.getpid()}_{r}.err" for r in range(2)]
        ps = [ctx.Process(target=worker, args=(r, port, impl, errs[r])) for r in range(2)]
        for p in ps:
            p.start()
        for p in ps:
            p.join(60)
            if p.is_alive():
                p.kill()
                bad.append(f"round {rnd}: a worker did not exit")
        for r, e in enumerate(errs):
            text = open(e).read() if os.path.exists(e) else ""
            os.unlink(e) if os.path.exists(e) else None
            lines = [ln for ln in text.splitlines() if "frame #" in ln or "recvVector" in ln or "TCPStore" in ln]
            if lines:
                bad.append(f"round {rnd}: worker{r} printed a C++ trace ({len(lines)} lines), first: {lines[0][:160]}")
    for b in bad:
        print(f"[{impl}] REPRO FAIL:", b)
    print("REPRO OK" if not bad else f"REPRO FAIL ({len(bad)})")
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
