"""A callback on torch.futures.collect_all([f1]) waits for another rpc_async future f2 whose
reply arrived in the same read as f1's (adapted from ../shared/repros/repro_reply_callbacks_read_together.py).

collect_all registers its callback on f1 in C++ (torch._C._collect_all), not through
RpcFuture.then / add_done_callback, so distgrad never marks f1 as having user callbacks
(``_dg_user``); f1's reply is completed by RpcAgent._finish_async in turn with f2's on the reading
thread, and set_result runs collect_all's C++ callback, which completes the collected future and
runs the user's Python callback there -- which waits for f2, queued behind it.

worker0 starts f1 = rpc_async(worker1, pair, 1) and f2 = rpc_async(worker1, pair, 2) and chains
f1.then(lambda f: f.value() + f2.wait()). On worker1 both calls meet at a barrier, so their two
replies leave back to back; worker0 is made to read them in one read (its threads are kept off
the GIL for 0.3 s while they arrive).

torch completes every reply as a task of its own on its RPC thread pool
(TensorPipeAgent::markFutureAsComplete), so f2 completes on another thread while f1's callback
waits: the chain gives 3.

Two ways the replies are read together on worker0:
  A. by a pool thread, with a request from worker1 in the same read (pair(2) sends worker0 a
     one-way call just before it returns);
  B. by the main thread, which is waiting in rpc_sync(worker1, ...) for its own reply.

Prints REPRO OK when the chain completes within 10 s in every round of both (`--impl torch` does).
"""
import argparse, multiprocessing as mp, os, queue, socket, sys, threading, time, warnings
import torch

warnings.filterwarnings("ignore")
BARRIER = [None]


def _rpc():
    import importlib
    return importlib.import_module("torch.distributed.rpc" if os.environ["REPRO_IMPL"] == "torch"
                                   else "distgrad.rpc")


def noop():
    return None


def pair(i, parties, ping):
    BARRIER[0].wait(10)
    if ping:  # a request to worker0 that leaves with the replies
        _rpc().rpc_async("worker0", noop)
    return i


def slow(parties):
    BARRIER[0].wait(10)
    time.sleep(0.5)
    return 0


def reset(parties):
    BARRIER[0] = threading.Barrier(parties)


def hog(seconds):
    """Keep every other thread of this process off the GIL for ``seconds``."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    finally:
        sys.setswitchinterval(old)


def worker(rank, port, impl, out, cases):
    os.environ["REPRO_IMPL"] = impl
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    os.environ.setdefault("DISTGRAD_SECRET", "e6322fbce9c88c169fbd6b1aba3050223d9e940b978cef4791345bab9c71edef")
    if impl == "torch":
        import torch.distributed.rpc as rpc
    else:
        import distgrad.rpc as rpc
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=16)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        results = {}
        for how in cases:
            hung = 0
            for rnd in range(10):
                rpc.rpc_sync("worker1", reset, args=(2 if how == "A" else 3,))
                f1 = rpc.rpc_async("worker1", pair, args=(1, 0, False))
                f2 = rpc.rpc_async("worker1", pair, args=(2, 0, how == "A"))
                chained = torch.futures.collect_all([f1]).then(lambda f, f1=f1, f2=f2: f1.value() + f2.wait())
                done = threading.Event()
                chained.add_done_callback(lambda _: done.set())
                if how == "A":
                    hog(0.3)
                else:
                    t = threading.Thread(target=hog, args=(0.3,))
                    t.start()
                    rpc.rpc_sync("worker1", slow, args=(3,))
                    t.join()
                if not done.wait(10):
                    hung += 1
                    print(f"[{impl}] {how} round {rnd}: f1's callback still waits for f2 after 10 s "
                          f"(f2 done: {f2.done()})", flush=True)
                    break  # this process's threads may now be stuck: no more rounds
                elif chained.value() != 3:
                    results.setdefault("wrong", []).append((how, chained.value()))
            results[how] = hung
            if hung:
                break
        out.put(results)
        if any(results.get(k) for k in ("A", "B")):
            out.close(); out.join_thread()
            os._exit(0)  # a thread is stuck: shutdown could not finish
    rpc.shutdown()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("torch", "distgrad"), default="distgrad")
    impl = ap.parse_args().impl
    res = {}
    for case in ("A", "B"):  # each in processes of its own (a hang leaves threads stuck)
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        ps = [ctx.Process(target=worker, args=(r, port, impl, out, (case,))) for r in range(2)]
        for p in ps:
            p.start()
        try:
            res.update(out.get(timeout=120))
        except queue.Empty:
            res["error"] = f"case {case}: no result within 120 s"
        for p in ps:
            p.join(20)
            if p.is_alive():
                p.kill()
    bad = []
    if "error" in res:
        bad.append(res["error"])
    for how, what in (("A", "read by a pool thread with a request"), ("B", "read by a caller in rpc_sync")):
        if res.get(how):
            bad.append(f"{how} ({what}): f1's callback waited forever for f2, whose reply was read "
                       "with f1's and is never completed")
    if res.get("wrong"):
        bad.append(f"wrong chained values: {res['wrong']}")
    for b in bad:
        print("REPRO FAIL:", b)
    print("REPRO OK" if not bad else f"REPRO FAIL ({len(bad)})")
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
