"""A trace with failed calls and a worker that dies in it (3 real workers): the file is
valid, trace-plot names the missing worker, marks the failures, draws a picture; and
trace-plot -o into a refused directory says what is wrong with the output, not the trace."""
import io, contextlib, os, signal, sys, tempfile, time, types
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import perfetto_problems, run_workers, strict_load


def _boom():
    raise ValueError("the callee's own error")


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _run(rank, world_size, where):
    import torch, distgrad, distgrad.rpc as rpc
    if rank != 0:
        rpc.api._barrier(["worker0", "worker1"]) if rank == 1 else time.sleep(60)
        return None
    with distgrad.trace(os.path.join(where, "fl.json"), timeout=5):
        rpc.rpc_sync("worker2", torch.add, args=(torch.ones(2), 1))
        for _ in range(3):
            try:
                rpc.rpc_sync("worker1", _boom)
            except Exception:  # noqa: BLE001
                pass
        try:
            rpc.rpc_sync("worker2", _die, timeout=5)
        except Exception:  # noqa: BLE001
            pass
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
    rpc.api._barrier(["worker0", "worker1"])
    return None


if __name__ == "__main__":
    from distgrad.trace.plot import failures, main
    from distgrad.trace.summary import summarize
    where = tempfile.mkdtemp(prefix="audit-fl-"); os.chmod(where, 0o700)
    run_workers(_run, world_size=3, timeout=120, args=(where,), expect_exit={2}, graceful=False)
    p = os.path.join(where, "fl.json")
    res = []
    doc = strict_load(p)
    probs = perfetto_problems(doc)
    res.append(f"{'PASS' if not probs else 'FAIL'} strict JSON + trace-event fields {probs[:3]}")
    s = summarize(doc)
    f = failures(s)
    res.append(f"{'PASS' if 'worker2' in s.missing else 'FAIL'} missing: {s.missing}")
    res.append(f"{'PASS' if len(f) >= 3 else 'FAIL'} failed calls marked: {len(f)} ({sorted({w for w, _ in f})})")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(types.SimpleNamespace(trace=p, output=os.path.join(where, "fl.png"), title=None))
    res.append(f"{'PASS' if rc == 0 and os.path.getsize(os.path.join(where, 'fl.png')) > 1000 else 'FAIL'} picture drawn (rc {rc}); "
               f"summary lines mention worker2: {[l for l in buf.getvalue().splitlines() if 'worker2' in l][:2]}")
    bad = tempfile.mkdtemp(dir=where); os.chmod(bad, 0o777)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(types.SimpleNamespace(trace=p, output=os.path.join(bad, "x.png"), title=None))
    out = buf.getvalue().strip()
    res.append(f"{'FAIL' if 'as a distgrad trace' in out else 'PASS'} -o into a world-writable dir: rc {rc}: {out[:170]}")
    print("\n".join(res))
    print("summary:", "FAIL" if any(l.startswith("FAIL") for l in res) else "PASS")
