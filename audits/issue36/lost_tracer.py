"""The tracer is SIGKILLed mid-trace while the two members keep calling each other;
then a member opens a new trace. 3 real workers on 127.0.0.1."""
import os, signal, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import perfetto_problems, run_workers, strict_load


def _run(rank, world_size, where):
    import torch, distgrad, distgrad.rpc as rpc
    from distgrad.rpc.pending import agent_or_none
    one = torch.ones(2)
    if rank == 0:
        distgrad.trace.start(os.path.join(where, "lost.json"), max_events=5000)
        rpc.rpc_sync("worker1", torch.add, args=(one, 1))
        rpc.rpc_sync("worker2", torch.add, args=(one, 1))
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    agent = agent_or_none()
    res = []
    other = "worker2" if rank == 1 else "worker1"
    deadline = time.monotonic() + 40
    n = 0
    while 0 not in agent.lost and time.monotonic() < deadline:
        rpc.rpc_sync(other, torch.add, args=(one, 1))   # traffic while the tracer dies
        n += 1
    lost_at = time.monotonic()
    while distgrad.trace.is_tracing() and time.monotonic() < lost_at + 10:
        rpc.rpc_sync(other, torch.add, args=(one, 1))
    stopped_in = time.monotonic() - lost_at
    res.append(f"{'PASS' if not distgrad.trace.is_tracing() else 'FAIL'} worker{rank}: stopped recording "
               f"{stopped_in:.2f} s after the tracer's loss was seen ({n} calls before)")
    rpc.api._barrier(["worker1", "worker2"])
    if rank == 1:
        p = os.path.join(where, "after.json")
        try:
            with distgrad.trace(p, timeout=10):
                with distgrad.trace.span("after", n=1):
                    for _ in range(10):
                        rpc.rpc_sync("worker2", torch.add, args=(one, 1))
            doc = strict_load(p)
            probs = perfetto_problems(doc)
            meta = doc["otherData"]["distgrad"]
            names = sorted(meta["workers"])
            ok = not probs and names == ["worker1", "worker2"] and any(
                e.get("cat") == "rpc.serve" for e in doc["traceEvents"])
            res.append(f"{'PASS' if ok else 'FAIL'} worker1 opened a new trace after the loss: workers {names}, "
                       f"missing {meta['missing']}, problems {probs[:3]}")
            kept = sum(1 for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == meta["workers"]["worker2"]["track"])
            res.append(f"{'PASS' if kept < 200 else 'FAIL'} worker2's events in the new file are the new trace's only ({kept})")
        except Exception as e:  # noqa: BLE001
            res.append(f"FAIL worker1's new trace: {type(e).__name__}: {str(e)[:200]}")
    rpc.api._barrier(["worker1", "worker2"])
    return res


if __name__ == "__main__":
    where = tempfile.mkdtemp(prefix="audit-lost-")
    os.chmod(where, 0o700)
    out = run_workers(_run, world_size=3, timeout=120, args=(where,), expect_exit={0}, graceful=False)
    lines = [ln for r in out[1:] for ln in r]
    print("\n".join(lines))
    print("summary:", "PASS" if lines and not any(l.startswith("FAIL") for l in lines) else "FAIL")
