"""torch.profiler used every way NEXT to a trace with profile_ops=True, in particular
started AFTER the trace opened (the fix only checks at start()). Each case runs in its
own 2-worker group (a crash of one does not hide the others); the parent checks the exit
code (SIGSEGV = -11), the user's profiler's result, the user's exception, and that the
trace file is written and is valid trace-event JSON.

Cases:
  cm_after      trace open, then `with torch.profiler.profile():` on the tracer
  sched_after   trace open, then a scheduled profile (wait=1, warmup=1, active=2) stepped
                through its active phase, with on_trace_ready, on the tracer
  thread_after  trace open, then a plain profile start()/stop() on another thread
  member_sched  trace open, then a scheduled profile stepped on worker1 (a member)
  legacy_after  trace open, then `with torch.autograd.profiler.profile():` on the tracer
  open_at_stop  trace open, a plain profile started on the tracer and still running when
                the trace's stop() runs, stopped after it
  sched_done    a scheduled profile that ran and stopped before the trace: profile_ops allowed
  nested_user   user's plain profile around a trace with profile_ops (refused, user's kept)
torch's own behaviour for a plain profile started under another (all-threads) one: the
inner one gets its events, the outer ends empty, no crash; the process dies only when the
outer one's export_chrome_trace() runs on that cancelled session - which distgrad's stop()
(ops.py OpsProfiler.stop) always does, on the tracer and on every member.
Run: cd <repo> && PYTHONPATH=$PWD DISTGRAD_PURE=1 python audits/issue36/profile_ops_user_after.py [case]"""
import json, os, subprocess, sys, tempfile
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

CASES = ["cm_after", "sched_after", "thread_after", "member_sched", "legacy_after", "open_at_stop", "sched_done",
         "nested_user"]


def _user_sched(steps=6):
    import torch
    from torch.profiler import profile, schedule
    got = {}
    p = profile(schedule=schedule(wait=1, warmup=1, active=2, repeat=1),
                on_trace_ready=lambda pr: got.setdefault("ready", len(pr.events())))
    x = torch.ones(8)
    err = None
    try:
        p.start()
        for _ in range(steps):
            x = torch.mm(x.view(2, 4), torch.ones(4, 2)).view(-1).repeat(2)
            p.step()
        p.stop()
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
    return {"ready": got.get("ready"), "error": err}


def _run(rank, world_size, where, case):
    import threading, torch, distgrad, distgrad.rpc as rpc
    from torch.profiler import profile
    if rank != 0:
        rpc.api._barrier(["worker0", "worker1"])
        return None
    out = {}
    path = os.path.join(where, "t.json")
    if case == "nested_user":
        with profile() as up:
            torch.ones(3) + 1
            try:
                distgrad.trace.start(path, profile_ops=True)
                out["start"] = "opened"
                distgrad.trace.stop()
            except Exception as e:  # noqa: BLE001
                out["start"] = f"{type(e).__name__}: {str(e)[:120]}"
            torch.ones(3) * 2
        out["user_events"] = len(up.events())
        rpc.api._barrier(["worker0", "worker1"])
        return out
    if case == "sched_done":
        out["user"] = _user_sched(6)
    distgrad.trace.start(path, profile_ops=True)
    rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
    try:
        if case == "cm_after":
            with profile() as up:
                torch.ones(3) + 1
            out["user"] = {"events": len(up.events())}
        elif case == "sched_after":
            out["user"] = _user_sched(6)
        elif case == "thread_after":
            box = {}

            def th():
                try:
                    p = profile(); p.start(); torch.ones(3) + 1; p.stop(); box["events"] = len(p.events())
                except Exception as e:  # noqa: BLE001
                    box["error"] = f"{type(e).__name__}: {str(e)[:150]}"
            t = threading.Thread(target=th); t.start(); t.join()
            out["user"] = box
        elif case == "legacy_after":
            with torch.autograd.profiler.profile() as up:
                torch.ones(3) + 1
            out["user"] = {"events": len(up.function_events)}
        elif case == "open_at_stop":
            up = profile(); up.start(); torch.ones(3) + 1
            try:
                distgrad.trace.stop()
                out["stop"] = "ok"
            except Exception as e:  # noqa: BLE001
                out["stop"] = f"{type(e).__name__}: {str(e)[:150]}"
            try:
                torch.ones(3) * 2; up.stop(); out["user"] = {"events": len(up.events())}
            except Exception as e:  # noqa: BLE001
                out["user"] = {"error": f"{type(e).__name__}: {str(e)[:150]}"}
            rpc.api._barrier(["worker0", "worker1"])
            return out
        elif case == "member_sched":
            out["user"] = rpc.rpc_sync("worker1", _user_sched, args=(6,))
    except Exception as e:  # noqa: BLE001
        out["user_exc"] = f"{type(e).__name__}: {str(e)[:150]}"
    rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
    try:
        distgrad.trace.stop()
        out["stop"] = "ok"
    except Exception as e:  # noqa: BLE001
        out["stop"] = f"{type(e).__name__}: {str(e)[:150]}"
    rpc.api._barrier(["worker0", "worker1"])
    return out


def one(case):
    from _common import run_workers, strict_load, perfetto_problems
    where = tempfile.mkdtemp(prefix="audit-pou-"); os.chmod(where, 0o700)
    out = run_workers(_run, world_size=2, timeout=120, args=(where, case))[0]
    p = os.path.join(where, "t.json")
    if os.path.exists(p):
        doc = strict_load(p)
        out["file_problems"] = perfetto_problems(doc)[:3]
        meta = doc.get("otherData", {}).get("distgrad", {})
        out["ops_meta"] = meta.get("ops")
        out["torch_ops"] = sum(1 for e in doc["traceEvents"] if e.get("cat") == "op")
    else:
        out["file"] = "missing"
    print("RESULT " + json.dumps(out, default=str))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        one(sys.argv[2]); sys.exit(0)
    cases = sys.argv[1:] or CASES
    bad = 0
    for case in cases:
        r = subprocess.run([sys.executable, __file__, "--one", case], capture_output=True, text=True, timeout=300)
        line = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
        if r.returncode != 0 or not line:
            tail = (r.stderr.strip().splitlines() or ["?"])[-1][:300]
            print(f"FAIL {case}: exit {r.returncode} ({'SIGSEGV' if r.returncode in (-11, 139) else tail})", flush=True)
            bad += 1
            continue
        res = json.loads(line[0][7:])
        ok = res.get("file") != "missing" and not res.get("file_problems")
        if case == "nested_user":
            ok = res.get("user_events", 0) > 0 and res.get("start") != "opened"
        else:
            ok = ok and res.get("stop") == "ok" and "user_exc" not in res
            if case == "open_at_stop":   # the trace's stop must not end the user's session
                ok = ok and (res.get("user") or {}).get("events", 0) > 0
        bad += not ok
        print(f"{'PASS' if ok else 'FAIL'} {case}: {json.dumps(res, default=str)[:700]}", flush=True)
    print("summary:", "FAIL" if bad else "PASS")
