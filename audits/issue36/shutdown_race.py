"""Shutdown races with a trace open (2 real workers on 127.0.0.1):
  stop_vs_shutdown  the tracer: one thread in stop() (the member's answer held 2 s)
                    while the main thread calls rpc.shutdown(); the member shuts down too
  member_ng_during  the member calls rpc.shutdown(graceful=False) while the tracer's
                    stop() waits for it (its answer held 2 s)
Checks: nothing hangs (each bounded), no exception other than a clear RuntimeError,
the file either written as valid trace-event JSON or its loss named, and after shutdown
nothing stays installed (recorder.ACTIVE, session._open) on either side.
Run: cd <repo> && PYTHONPATH=$PWD DISTGRAD_PURE=1 python audits/issue36/shutdown_race.py [case]"""
import json, os, subprocess, sys, tempfile, time
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _hold(seconds):
    import threading
    from distgrad.trace import session

    def hold():
        with session._lock:
            time.sleep(seconds)
    threading.Thread(target=hold, daemon=True).start()


def _left():
    from distgrad.trace import recorder, session
    return {"active": recorder.ACTIVE is not None, "open": bool(session._open)}


def _run(rank, world_size, where, case):
    import threading, torch, distgrad, distgrad.rpc as rpc
    if rank == 1:
        if case == "member_ng_during":
            rpc.api._barrier(["worker0", "worker1"])   # the tracer is about to stop()
            time.sleep(0.5)
            t0 = time.monotonic()
            rpc.shutdown(graceful=False)
            return {"member_shutdown_s": round(time.monotonic() - t0, 1), "left": _left()}
        rpc.api._barrier(["worker0", "worker1"])
        t0 = time.monotonic()
        rpc.shutdown()
        return {"member_shutdown_s": round(time.monotonic() - t0, 1), "left": _left()}
    out = {}
    distgrad.trace.start(os.path.join(where, "t.json"), timeout=10)
    rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
    rpc.rpc_sync("worker1", _hold, args=(2.0,))
    box = {}

    def stopper():
        t0 = time.monotonic()
        try:
            box["stop"] = distgrad.trace.stop()
        except BaseException as e:  # noqa: BLE001
            box["stop"] = f"{type(e).__name__}: {str(e)[:150]}"
        box["stop_s"] = round(time.monotonic() - t0, 1)
    th = threading.Thread(target=stopper)
    if case == "stop_vs_shutdown":
        rpc.api._barrier(["worker0", "worker1"])
        th.start(); time.sleep(0.2)
        t0 = time.monotonic()
        try:
            rpc.shutdown()
            out["shutdown"] = "ok"
        except BaseException as e:  # noqa: BLE001
            out["shutdown"] = f"{type(e).__name__}: {str(e)[:150]}"
        out["shutdown_s"] = round(time.monotonic() - t0, 1)
        th.join(30)
    else:
        rpc.api._barrier(["worker0", "worker1"])
        th.start(); th.join(60)
        try:
            rpc.shutdown()
            out["shutdown"] = "ok"
        except BaseException as e:  # noqa: BLE001
            out["shutdown"] = f"{type(e).__name__}: {str(e)[:150]}"
    out.update(box)
    out["left"] = _left()
    return out


def one(case):
    from _common import run_workers, strict_load, perfetto_problems
    where = tempfile.mkdtemp(prefix="audit-sdr-"); os.chmod(where, 0o700)
    t0 = time.monotonic()
    res = run_workers(_run, world_size=2, timeout=150, args=(where, case), init=True,
                      expect_exit={1} if case == "member_ng_during" else None)
    out = {"tracer": res[0], "member": res[1], "wall_s": round(time.monotonic() - t0, 1)}
    p = os.path.join(where, "t.json")
    out["file"] = perfetto_problems(strict_load(p))[:3] if os.path.exists(p) else "missing"
    print("RESULT " + json.dumps(out, default=str))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        one(sys.argv[2]); sys.exit(0)
    bad = 0
    for case in sys.argv[1:] or ["stop_vs_shutdown", "member_ng_during"]:
        try:
            r = subprocess.run([sys.executable, __file__, "--one", case], capture_output=True, text=True, timeout=240)
        except subprocess.TimeoutExpired:
            print(f"FAIL {case}: hung past 240 s"); bad += 1; continue
        line = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
        if not line:
            print(f"FAIL {case}: exit {r.returncode}: {(r.stderr.strip().splitlines() or ['?'])[-1][:300]}"); bad += 1
            continue
        res = json.loads(line[0][7:])
        t = res["tracer"] or {}
        left = [w for w in ("tracer", "member") if (res.get(w) or {}).get("left", {}).get("active")
                or (res.get(w) or {}).get("left", {}).get("open")]
        wrote = res["file"] == []
        stop_ok = str(t.get("stop", "")).startswith("/") or "RuntimeError" in str(t.get("stop", ""))
        ok = not left and stop_ok and res["file"] != ["?"] and (wrote or "missing" == res["file"])
        if not wrote and not str(t.get("stop", "")).startswith("RuntimeError"):
            ok = False   # lost with nothing said
        bad += not ok
        print(f"{'PASS' if ok else 'FAIL'} {case}: {json.dumps(res, default=str)[:800]}", flush=True)
    print("summary:", "FAIL" if bad else "PASS")
