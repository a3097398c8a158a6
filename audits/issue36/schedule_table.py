"""distgrad.trace.schedule against torch.profiler.schedule (third audit).
  table     for every (wait, warmup, active, repeat, skip_first) in a grid (wait/warmup 0..3,
            active 1..3, repeat 0..3, skip_first 0..3) and steps 0..59: torch's ProfilerAction
            (torch.profiler.schedule) vs Schedule.phase; also which steps end a file
            (torch RECORD_AND_SAVE vs distgrad's close in step()), driven with a fake start/stop
  kwargs    torch's own keyword skip_first_wait accepted; an unknown keyword refused at once
  real      2 real workers on 127.0.0.1: untraced steps install nothing (recorder.ACTIVE, the
            wrappers), a traced cycle writes a valid file per cycle with 'step N' spans,
            a start that fails (a trace already open) does not stop the job, close() twice,
            step() after close(), an on_trace_ready that raises. Both workers run the same
            schedule at once: worker1's starts fail while worker0's trace is open (logged,
            its job goes on), which is a further "failure to start" case
Run: cd <repo> && PYTHONPATH=$PWD DISTGRAD_PURE=1 python audits/issue36/schedule_table.py"""
import itertools, os, sys, tempfile, warnings
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run_workers, strict_load, perfetto_problems


def table():
    from torch.profiler import schedule as tsched, ProfilerAction as A
    import distgrad.trace as tr
    from distgrad.trace import schedule as S
    mism, save_mism, n = [], [], 0
    real_start, real_stop = S.__dict__.get("start"), None
    for wait, warmup, active, repeat, skip in itertools.product(range(4), range(4), range(1, 4),
                                                               range(4), range(4)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            f = tsched(wait=wait, warmup=warmup, active=active, repeat=repeat, skip_first=skip)
        # fake start/stop: count what is open when
        log = []
        orig = tr.start, tr.stop
        tr.start = lambda p, **k: log.append(("start", p))
        tr.stop = lambda: (log.append(("stop",)), "f")[1]
        try:
            s = tr.schedule("/tmp/a3/t.json", wait=wait, warmup=warmup, active=active,
                            repeat=repeat, skip_first=skip)
            saved_at = []
            for step in range(60):
                n += 1
                t = f(step)
                want = {A.NONE: "none", A.WARMUP: "warmup", A.RECORD: "active",
                        A.RECORD_AND_SAVE: "active"}[t]
                got = s.phase(step)
                if got != want:
                    mism.append((wait, warmup, active, repeat, skip, step, want, got))
                before = len(s.written)
                s.step()           # ends step `step`
                if len(s.written) > before:
                    saved_at.append(step)
            torch_saves = [st for st in range(60) if f(st) == A.RECORD_AND_SAVE]
            if saved_at != torch_saves:
                save_mism.append(((wait, warmup, active, repeat, skip), torch_saves[:5], saved_at[:5]))
            s.close()
        finally:
            tr.start, tr.stop = orig
    print(f"table: {n} (combination, step) pairs; phase mismatches {len(mism)}; "
          f"file-boundary mismatches {len(save_mism)}")
    for m in mism[:5]:
        print("   phase", m)
    for m in save_mism[:5]:
        print("   saves (torch first 5, distgrad first 5)", m)
    return not mism and not save_mism


def kwargs():
    """torch's skip_first_wait is accepted and works (the table covers its phases);
    a keyword start() does not take is refused when the schedule is made."""
    import torch.profiler as tp, distgrad.trace as tr
    tp.schedule(wait=1, warmup=1, active=1, skip_first_wait=1)
    tr.schedule("/tmp/a3/k.json", wait=1, warmup=1, active=1, skip_first_wait=1)
    try:
        tr.schedule("/tmp/a3/k.json", wait=1, warmup=1, active=1, no_such_keyword=1)
    except TypeError as e:
        print(f"kwargs: skip_first_wait accepted; an unknown keyword refused at construction: {e}")
        return True
    print("kwargs: an unknown keyword was accepted at construction (each cycle's start() "
          "would fail, logged only)")
    return False


def _run(rank, world_size, where):
    import torch, distgrad, distgrad.rpc as rpc, logging
    from distgrad.trace import recorder
    out = {"installed_untraced": [], "errors": []}
    ready = []
    s = distgrad.trace.schedule(os.path.join(where, "c{n}.json"), wait=2, warmup=1, active=2,
                                repeat=2, on_trace_ready=ready.append)
    for step in range(12):
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), step))
        if s.phase(step) == "none" and recorder.ACTIVE is not None:
            out["installed_untraced"].append(step)
        s.step()
    s.close(); s.close()
    out["written"] = s.written; out["ready"] = ready
    try:
        s.step(); out["step_after_close"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["step_after_close"] = f"{type(e).__name__}: {e}"
    # a start that fails: a trace already open by the user
    distgrad.trace.start(os.path.join(where, "user.json"))
    s2 = distgrad.trace.schedule(os.path.join(where, "x.json"), wait=0, active=2)
    try:
        for step in range(4):
            rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), step)); s2.step()
        s2.close(); out["failed_start"] = f"job went on, written {s2.written}"
    except Exception as e:  # noqa: BLE001
        out["failed_start"] = f"STOPPED {type(e).__name__}: {e}"
    out["user_file"] = distgrad.trace.stop()
    # an on_trace_ready that raises
    def boom(p):
        raise OSError("upload failed")
    s3 = distgrad.trace.schedule(os.path.join(where, "b.json"), wait=0, active=1, on_trace_ready=boom)
    try:
        s3.step(); out["raising_ready"] = "job went on"
    except Exception as e:  # noqa: BLE001
        out["raising_ready"] = f"propagated {type(e).__name__}: {e}"
    out["open_after"] = distgrad.trace.is_tracing() if rank == 0 else None
    return out


def real():
    where = tempfile.mkdtemp(prefix="audit-sched-"); os.chmod(where, 0o700)
    res = run_workers(_run, world_size=2, timeout=180, args=(where,))
    r = res[0]
    for k, v in r.items():
        print(f"real: {k}: {v}")
    ok = not r["installed_untraced"] and len(r["written"]) == 2 and r["ready"] == r["written"]
    ok = ok and "STOPPED" not in r["failed_start"] and not r["open_after"]
    for p in r["written"]:
        doc = strict_load(p)
        probs = perfetto_problems(doc)
        steps = sorted(e["name"] for e in doc["traceEvents"] if e.get("cat") == "step")
        print(f"real: {os.path.basename(p)} problems={probs[:3]} step spans={steps}")
        ok = ok and not probs
    return ok


if __name__ == "__main__":
    parts = {"table": table(), "kwargs": kwargs(), "real": real()}
    for k, v in parts.items():
        print(("PASS " if v else "FAIL ") + k)
    print("PASS" if all(parts.values()) else "FAIL")
