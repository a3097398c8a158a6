"""What torch.get_num_threads() a user observes, torch.distributed.rpc vs distgrad.

Two spawned workers on 127.0.0.1, 4 RPC worker threads each. Run:
    python repro_counts.py --impl torch
    PYTHONPATH=<worktree> DISTGRAD_PURE=1 python repro_counts.py --impl distgrad
Prints one JSON line of observations per impl (compare the two).

Scenarios (worker0 drives):
 A  user thread + threadpoolctl (openmp only), torch.set_num_threads never called:
    main's count inside ``with threadpool_limits(1, user_api="openmp")`` before/after
    rpc_async(...).wait(), rpc_sync, and a dist_autograd.backward that reaches worker1.
 B  same with blas+openmp limits after torch.set_num_threads(2) (global set).
 C  user thread, global changed by another thread: main set 2; a user thread sets 1;
    main's count before/after fut.wait() and backward.
 D  serving threads: 4 calls held together on worker1 (each its own thread) report
    their count; worker1's main then sets n=max+1; 4 more calls report again.
 E  then-callbacks on worker0: count in a callback; main sets first+1; again.
 F  a served function calls torch.set_num_threads(k); the next 4 held calls report.
 C2 a served function on worker0 (called back from worker1) sets 1; main had 2:
    main's count after its next rpc_sync / fut.wait().
 H  main's and a served call's count at start (try OMP_NUM_THREADS / MKL_NUM_THREADS).
 G  hook counts in a dist backward: a hook on worker1 (remote part) and on worker0
    (local part, which the user's thread runs in distgrad).
"""
import argparse, json, multiprocessing as mp, os, queue, socket, threading, time, warnings
warnings.filterwarnings("ignore")

THREADS = 4
_B = {}
_MAIN = {}


def _barrier():
    b = _B.get("b")
    if b is None:
        b = _B.setdefault("b", threading.Barrier(THREADS))
    return b


def _served_count():
    import torch
    return torch.get_num_threads()


def held_count():
    import torch
    n = torch.get_num_threads()
    _barrier().wait(timeout=30)
    return threading.current_thread().name, threading.get_ident(), n


def set_main(k, v):
    _MAIN[k] = v


def main_has(k):
    return k in _MAIN


def set_threads(k):
    import torch
    torch.set_num_threads(k)
    return torch.get_num_threads()


_HOOKED = []


def fwd_hook(x):
    import torch
    w = torch.ones(3, requires_grad=True)

    def h(g):
        _HOOKED.append((threading.current_thread().name, torch.get_num_threads()))
        return g
    w.register_hook(h)
    return x * w


def hooked():
    return list(_HOOKED)


def add1(x):
    return x + 1


def set_on_caller(k):
    """Served on worker1: a user function that sets worker0's count by an RPC back."""
    if os.environ["REPRO_IMPL"] == "torch":
        import torch.distributed.rpc as rpc
    else:
        import distgrad.rpc as rpc
    return rpc.rpc_sync("worker0", set_threads, args=(k,))


def worker(rank, port, impl, out):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    os.environ["REPRO_IMPL"] = impl
    os.environ.setdefault("DISTGRAD_SECRET", "e6322fbce9c88c169fbd6b1aba3050223d9e940b978cef4791345bab9c71edef")
    import torch
    if impl == "torch":
        import torch.distributed.rpc as rpc
        import torch.distributed.autograd as dist_autograd
    else:
        import distgrad.rpc as rpc
        import distgrad.autograd as dist_autograd
    from threadpoolctl import threadpool_limits
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                           num_worker_threads=THREADS)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    res = {}
    if rank == 1:
        while "n" not in _MAIN:
            time.sleep(0.01)
        torch.set_num_threads(_MAIN["n"])
        _MAIN["set"] = True
        while not _MAIN.get("done"):
            time.sleep(0.01)
    else:
        g = torch.get_num_threads  # initializes main (as torch's own first op would)
        res["H_start"] = {"main": g(), "served": rpc.rpc_sync("worker1", _served_count)}

        def backward_remote():
            with dist_autograd.context() as cid:
                x = torch.ones(3, requires_grad=True)
                y = rpc.rpc_sync("worker1", add1, args=(x,))
                dist_autograd.backward(cid, [y.sum()])

        # A
        with threadpool_limits(limits=1, user_api="openmp"):
            a = {"in_limits": g()}
            rpc.rpc_sync("worker1", add1, args=(torch.ones(1),))
            a["after_rpc_sync"] = g()
            rpc.rpc_async("worker1", add1, args=(torch.ones(1),)).wait()
            a["after_fut_wait"] = g()
        with threadpool_limits(limits=1, user_api="openmp"):
            a["in_limits_2"] = g()
            backward_remote()
            a["after_backward"] = g()
        res["A_openmp_limit_global_unset"] = a
        # B
        torch.set_num_threads(2)
        with threadpool_limits(limits=1):
            b = {"in_limits": g()}
            rpc.rpc_async("worker1", add1, args=(torch.ones(1),)).wait()
            b["after_fut_wait"] = g()
        with threadpool_limits(limits=1):
            b["in_limits_2"] = g()
            backward_remote()
            b["after_backward"] = g()
        res["B_limit_global_2"] = b
        # C
        torch.set_num_threads(2)
        t = threading.Thread(target=torch.set_num_threads, args=(1,))
        t.start(); t.join()
        c = {"main_after_other_thread_set_1": g()}
        rpc.rpc_sync("worker1", add1, args=(torch.ones(1),))
        c["after_rpc_sync"] = g()
        rpc.rpc_async("worker1", add1, args=(torch.ones(1),)).wait()
        c["after_fut_wait"] = g()
        torch.set_num_threads(2)
        t = threading.Thread(target=torch.set_num_threads, args=(1,))
        t.start(); t.join()
        c["again"] = g()
        backward_remote()
        c["after_backward"] = g()
        res["C_global_changed_elsewhere"] = c
        # C2: a served function (worker1 -> worker0) sets 1; main had 2
        torch.set_num_threads(2)
        c2 = {"served_set_returned": rpc.rpc_sync("worker1", set_on_caller, args=(1,)), "main_then": g()}
        rpc.rpc_sync("worker1", add1, args=(torch.ones(1),))
        c2["after_rpc_sync"] = g()
        rpc.rpc_async("worker1", add1, args=(torch.ones(1),)).wait()
        c2["after_fut_wait"] = g()
        res["C2_served_set_leaks_to_main"] = c2
        torch.set_num_threads(2)

        # D
        def burst():
            fs = [rpc.rpc_async("worker1", held_count, timeout=60) for _ in range(THREADS)]
            return [f.wait() for f in fs]
        before = burst()
        n = max(x[2] for x in before) + 1
        rpc.rpc_sync("worker1", set_main, args=("n", n))
        while not rpc.rpc_sync("worker1", main_has, args=("set",)):
            time.sleep(0.01)
        after = burst()
        res["D_serving"] = {"before": [x[2] for x in before], "n": n, "after": [x[2] for x in after],
                            "distinct_threads_before": len({x[1] for x in before}),
                            "same_threads": sorted(x[1] for x in before) == sorted(x[1] for x in after)}

        # E
        def cbc():
            return rpc.rpc_async("worker1", add1, args=(torch.ones(1),)).then(
                lambda f: (threading.current_thread() is threading.main_thread(), torch.get_num_threads())).wait()
        e1 = cbc()
        torch.set_num_threads(e1[1] + 1)
        e2 = cbc()
        res["E_callbacks"] = {"first": e1, "after_main_set_first+1": e2}
        torch.set_num_threads(2)

        # F
        k = rpc.rpc_sync("worker1", set_threads, args=(1,))
        res["F_served_set"] = {"in_call": k, "next_burst": [x[2] for x in burst()]}
        rpc.rpc_sync("worker1", set_threads, args=(2,))

        # G
        _HOOKED.clear()
        with dist_autograd.context() as cid:
            x = torch.ones(3, requires_grad=True)
            y = rpc.rpc_sync("worker1", fwd_hook, args=(x,))
            w0 = torch.ones(3, requires_grad=True)

            def h(gr):
                _HOOKED.append((threading.current_thread().name, threading.current_thread() is threading.main_thread(),
                                torch.get_num_threads()))
                return gr
            z = y * w0
            w0.register_hook(h)
            dist_autograd.backward(cid, [z.sum()])
        res["G_hooks"] = {"worker1": rpc.rpc_sync("worker1", hooked), "worker0": list(_HOOKED)}
        rpc.rpc_sync("worker1", set_main, args=("done", True))
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
        res = out.get(timeout=150)
    except queue.Empty:
        res = None
    for p in ps:
        p.join(30)
        if p.is_alive():
            p.kill()
    print(impl, json.dumps(res))


if __name__ == "__main__":
    main()
