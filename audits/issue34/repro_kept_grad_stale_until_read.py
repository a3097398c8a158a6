"""A tensor taken from get_gradients after pass 1 must show the sum as soon as pass 2's
dist_autograd.backward returns (torch: DistAutogradContext::accumulateGrad adds into the
context's tensor in place, `variable_grad += new_grad`, during the backward), without another
get_gradients call.

distgrad (autograd/context.py, accumulate_fresh lazy path): a pass's results wait in
``_pending`` and are only added into the kept tensor when something reads the context
(get_gradients -> _settle). Until then the user's tensor holds pass 1's value.

One process (RPC world_size=1). Cases: plain two passes; retain_graph twice on one root; a leaf
kept by another thread that polls it after backward returned. REPRO OK when each kept tensor shows
the sum right after the second backward (`--impl torch` does).
"""
import argparse, os, queue, socket, threading, warnings
import torch
warnings.filterwarnings("ignore")


def run(impl):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    os.environ.setdefault("DISTGRAD_SECRET", "e6322fbce9c88c169fbd6b1aba3050223d9e940b978cef4791345bab9c71edef")
    if impl == "torch":
        import torch.distributed.rpc as rpc
        import torch.distributed.autograd as da
    else:
        import distgrad.rpc as rpc
        import distgrad.autograd as da
    rpc.init_rpc("worker0", rank=0, world_size=1,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}"))
    bad = []
    try:
        x = torch.ones(3, requires_grad=True)
        with da.context() as cid:
            da.backward(cid, [(x * 3).sum()])
            g1 = da.get_gradients(cid)[x]
            da.backward(cid, [(x * 5).sum()])
            seen = g1.tolist()
            if seen != [8.0] * 3:
                bad.append(f"plain: the tensor kept after pass 1 holds {seen} after pass 2 (torch: 8s)")
        x = torch.ones(3, requires_grad=True)
        with da.context() as cid:
            loss = (x * x * 3).sum()
            da.backward(cid, [loss], retain_graph=True)
            g1 = da.get_gradients(cid)[x]
            da.backward(cid, [loss])
            seen = g1.tolist()
            if seen != [12.0] * 3:
                bad.append(f"retain_graph: the tensor kept after pass 1 holds {seen} after pass 2 (torch: 12s)")
        # another thread holds the tensor and reads it once the trainer says pass 2 is done
        x = torch.ones(3, requires_grad=True)
        with da.context() as cid:
            da.backward(cid, [(x * 3).sum()])
            g1 = da.get_gradients(cid)[x]
            done, got = threading.Event(), []
            t = threading.Thread(target=lambda: (done.wait(10), got.append(g1.tolist())))
            t.start()
            da.backward(cid, [(x * 5).sum()])
            done.set(); t.join()
            if got != [[8.0] * 3]:
                bad.append(f"watcher: another thread reads {got} after pass 2 returned (torch: 8s)")
    finally:
        rpc.shutdown()
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("torch", "distgrad"), default="distgrad")
    impl = ap.parse_args().impl
    res = queue.Queue()

    def go():
        try:
            res.put(run(impl))
        except BaseException as e:  # noqa: BLE001
            res.put([f"{type(e).__name__}: {e}"])
    threading.Thread(target=go, daemon=True).start()
    try:
        bad = res.get(timeout=120)
    except queue.Empty:
        bad = ["no result within 120 s (hang)"]
    for b in bad:
        print(f"[{impl}] REPRO FAIL:", b)
    print("REPRO OK" if not bad else f"REPRO FAIL ({len(bad)})", flush=True)
    os._exit(0 if not bad else 1)


if __name__ == "__main__":
    main()
