"""Small facts about rpc_async futures with callbacks, compared with torch:
  1. add_done_callback / then on an already-completed future run at once, on the calling thread;
  2. a then() callback that raises: the chained future carries the error (its message kept);
  3. a remote error reaches then()'s callback as fut.wait() raising;
  4. a timeout (timeout=0.2 on a 2 s call) reaches add_done_callback with an error;
  5. a callback registered from inside another future's callback (both replies in flight) runs;
  6. torch.futures.wait_all over rpc_async futures with callbacks.
Prints REPRO OK when every fact holds (`--impl torch` does).
"""
import argparse, multiprocessing as mp, os, queue, socket, threading, time, warnings
import torch
warnings.filterwarnings("ignore")


def slow(x, t):
    import time
    time.sleep(t)
    return x


def boom():
    raise ValueError("remote boom")


def worker(rank, port, impl, out):
    os.environ.setdefault("DISTGRAD_SECRET", "e6322fbce9c88c169fbd6b1aba3050223d9e940b978cef4791345bab9c71edef")
    if impl == "torch":
        import torch.distributed.rpc as rpc
    else:
        import distgrad.rpc as rpc
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=4)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    bad = []
    if rank == 0:
        try:
            me = threading.current_thread()
            f = rpc.rpc_async("worker1", slow, args=(1, 0.0)); f.wait()
            seen = []
            f.add_done_callback(lambda fu: seen.append(threading.current_thread() is me))
            g = f.then(lambda fu: (seen.append(threading.current_thread() is me), fu.value() + 1)[1])
            if seen != [True, True] or not g.done() or g.value() != 2:
                bad.append(f"1: callbacks on a done future: {seen}, chained done {g.done()}")
            h = rpc.rpc_async("worker1", slow, args=(1, 0.1)).then(lambda fu: 1 / 0)
            try:
                h.wait(); bad.append("2: no error")
            except Exception as e:  # noqa: BLE001
                if "division by zero" not in str(e):
                    bad.append(f"2: {type(e).__name__}: {e}")
            got = []
            rpc.rpc_async("worker1", boom).then(lambda fu: got.append(_err(fu))).wait()
            if not got or "remote boom" not in got[0]:
                bad.append(f"3: {got}")
            ev, got = threading.Event(), []
            rpc.rpc_async("worker1", slow, args=(1, 2.0), timeout=0.2).add_done_callback(
                lambda fu: (got.append(_err(fu)), ev.set()))
            if not ev.wait(10) or not got[0]:
                bad.append(f"4: timeout callback: {got}")
            ev, got = threading.Event(), []
            f1 = rpc.rpc_async("worker1", slow, args=(1, 0.2))
            f2 = rpc.rpc_async("worker1", slow, args=(2, 0.4))
            f1.add_done_callback(lambda fu: f2.add_done_callback(lambda fv: (got.append(fu.value() + fv.value()), ev.set())))
            if not ev.wait(10) or got != [3]:
                bad.append(f"5: nested registration: {got}")
            fs = [rpc.rpc_async("worker1", slow, args=(i, 0.05)) for i in range(8)]
            chained = [f.then(lambda fu: fu.value() * 2) for f in fs]
            vals = torch.futures.wait_all(chained)
            if vals != [2 * i for i in range(8)]:
                bad.append(f"6: wait_all: {vals}")
        except BaseException as e:  # noqa: BLE001
            bad.append(f"error: {type(e).__name__}: {e}")
        out.put(bad)
    rpc.shutdown()


def _err(fu):
    try:
        fu.wait()
        return ""
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


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
        bad = out.get(timeout=120)
    except queue.Empty:
        bad = ["no result within 120 s"]
    for p in ps:
        p.join(30)
        if p.is_alive():
            p.kill()
    for b in bad:
        print(f"[{impl}] REPRO FAIL:", b)
    print("REPRO OK" if not bad else f"REPRO FAIL ({len(bad)})")
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
