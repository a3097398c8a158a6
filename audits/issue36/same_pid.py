"""Workers that are each OS pid 1 (a PID namespace each, `unshare --pid --fork`, as
containers give): the trace keeps them apart, labels say pid 1, trace-plot sees 2
workers and a critical path. Falls back to saying SKIP where unshare is missing."""
import json, os, shutil, socket, subprocess, sys, tempfile, time


def worker(rank, port, where):
    import torch, distgrad, distgrad.rpc as rpc
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    print(f"worker{rank} os pid {os.getpid()}", flush=True)
    if rank == 0:
        with distgrad.trace(os.path.join(where, "pid1.json")):
            for _ in range(5):
                rpc.rpc_sync("worker1", torch.mm, args=(torch.ones(50, 50), torch.ones(50, 50)))
    rpc.shutdown()


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    if not shutil.which("unshare") or subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"]).returncode:
        print("SKIP: no unshare --pid here"); return
    where = tempfile.mkdtemp(prefix="audit-pid1-"); os.chmod(where, 0o700)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    env = dict(os.environ, DISTGRAD_SECRET="audit-secret-" + os.urandom(16).hex(), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, os.path.abspath(__file__),
                               "worker", str(r), str(port), where], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill(); p.wait(5)
    pids = [ln for o in outs for ln in o.splitlines() if "os pid" in ln]
    print("workers say:", pids)
    path = os.path.join(where, "pid1.json")
    if not os.path.exists(path):
        print("FAIL no trace written:", outs[0][-800:]); return
    doc = json.load(open(path))
    labels = [e["args"]["labels"] for e in doc["traceEvents"] if e.get("name") == "process_labels"]
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    from distgrad.trace.summary import summarize, report
    s = summarize(doc)
    ok = len(names) == 2 and all("pid 1" in l for l in labels) and len(s.workers) == 2 and s.path
    print(f"{'PASS' if ok else 'FAIL'} tracks {names}, labels {labels}, trace-plot workers {s.workers}, "
          f"critical path {sum(b - a for _, a, b, *_ in s.path) / 1e3:.3f} ms")
    print(report(s).splitlines()[5] if len(report(s).splitlines()) > 5 else "")
    print("summary:", "PASS" if ok else "FAIL")


if __name__ == "__main__":
    main()
