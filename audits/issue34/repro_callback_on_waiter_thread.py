"""A done-callback of an rpc_async future runs on the thread that waits for it, inside wait().

worker0: f = rpc_async(worker1, slow) (replies after 0.3 s); f.add_done_callback(cb), where cb
takes a lock that the main thread holds while it waits (``with lock: f.wait()``), a common way to
guard shared results.

torch: a reply is completed on an RPC pool thread (TensorPipeAgent::markFutureAsComplete ->
Future::markCompleted): the future is marked completed and waiters woken *before* the callbacks
run, on that pool thread. wait() returns, main releases the lock, cb takes it: no deadlock, and
the callback never runs on the waiting thread.

Prints REPRO OK when, in every round, cb got the lock and did not run on the main thread.
"""
import argparse, multiprocessing as mp, os, queue, socket, threading, time, warnings
warnings.filterwarnings("ignore")


def slow(x):
    import time
    time.sleep(0.3)
    return x + 1


def worker(rank, port, impl, out):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    os.environ.setdefault("DISTGRAD_SECRET", "e6322fbce9c88c169fbd6b1aba3050223d9e940b978cef4791345bab9c71edef")
    if impl == "torch":
        import torch.distributed.rpc as rpc
    else:
        import distgrad.rpc as rpc
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=8)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        res = []
        main = threading.current_thread()
        for rnd in range(5):
            lock = threading.Lock()
            rec = {}
            ev = threading.Event()

            def cb(fut, rec=rec, lock=lock, ev=ev):
                rec["main"] = threading.current_thread() is main
                ok = lock.acquire(timeout=3)
                rec["locked"] = ok
                if ok:
                    lock.release()
                ev.set()

            f = rpc.rpc_async("worker1", slow, args=(rnd,))
            f.add_done_callback(cb)
            t0 = time.time()
            with lock:
                v = f.wait()
            waited = time.time() - t0
            ev.wait(10)
            res.append((rnd, v, rec.get("main"), rec.get("locked"), round(waited, 2)))
        out.put(res)
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
        res = out.get(timeout=120)
    except queue.Empty:
        res = None
    for p in ps:
        p.join(30)
        if p.is_alive():
            p.kill()
    bad = []
    if res is None:
        bad.append("no result within 120 s")
    else:
        for rnd, v, on_main, locked, waited in res:
            print(f"[{impl}] round {rnd}: value {v}, callback on main thread: {on_main}, "
                  f"callback got the lock: {locked}, wait() took {waited} s")
            if v != rnd + 1 or on_main or not locked:
                bad.append(f"round {rnd}: callback ran on the waiting thread={on_main}, got lock={locked}")
    for b in bad:
        print("REPRO FAIL:", b)
    print("REPRO OK" if not bad else f"REPRO FAIL ({len(bad)})")
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
