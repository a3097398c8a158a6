"""A signal in a member while the tracer's start() waits on it (its _begin held 3 s):
  sigint_caught  the member's main thread gets SIGINT (Ctrl-C in its terminal) and the
                 user's code catches KeyboardInterrupt and goes on: the trace should open
                 and close normally with the member's events
  sigterm        the member is ended by SIGTERM (its default action) mid-start: start()
                 and stop() must not hang, the member named missing, the file valid
2 real workers on 127.0.0.1.
Run: cd <repo> && PYTHONPATH=$PWD DISTGRAD_PURE=1 python audits/issue36/signal_member.py"""
import os, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run_workers, strict_load, perfetto_problems


def _hold_and_signal(seconds, sig):
    import signal, threading
    from distgrad.trace import session

    def hold():
        with session._lock:
            time.sleep(0.5)
            os.kill(os.getpid(), getattr(signal, sig))
            time.sleep(seconds)
    threading.Thread(target=hold, daemon=True).start()


def _run(rank, world_size, where, sig):
    import torch, distgrad, distgrad.rpc as rpc
    if rank != 0:
        caught = 0
        for _ in range(200):      # the user's loop, catching Ctrl-C
            try:
                time.sleep(0.05)
            except KeyboardInterrupt:
                caught += 1
        rpc.api._barrier(["worker0", "worker1"])
        return {"caught": caught, "tracing_now": distgrad.trace.is_tracing()}
    out = {}
    rpc.rpc_sync("worker1", _hold_and_signal, args=(3.0, sig))
    t0 = time.monotonic()
    try:
        distgrad.trace.start(os.path.join(where, "t.json"), timeout=15)
        out["start"] = "ok"
    except BaseException as e:  # noqa: BLE001
        out["start"] = f"{type(e).__name__}: {str(e)[:150]}"
    out["start_s"] = round(time.monotonic() - t0, 1)
    try:
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1), timeout=5)
        out["call"] = "ok"
    except Exception as e:  # noqa: BLE001
        out["call"] = f"{type(e).__name__}: {str(e)[:80]}"
    t0 = time.monotonic()
    try:
        out["stop"] = distgrad.trace.stop()
    except BaseException as e:  # noqa: BLE001
        out["stop"] = f"{type(e).__name__}: {str(e)[:150]}"
    out["stop_s"] = round(time.monotonic() - t0, 1)
    if sig == "SIGINT":
        rpc.api._barrier(["worker0", "worker1"])
    return out


if __name__ == "__main__":
    bad = 0
    for sig in ("SIGINT", "SIGTERM"):
        where = tempfile.mkdtemp(prefix="audit-sig-"); os.chmod(where, 0o700)
        try:
            res = run_workers(_run, world_size=2, timeout=120, args=(where, sig),
                              expect_exit={1} if sig == "SIGTERM" else None)
        except Exception as e:  # noqa: BLE001
            print(f"FAIL {sig}: {str(e)[:300]}"); bad += 1; continue
        t = res[0]
        p = os.path.join(where, "t.json")
        probs = perfetto_problems(doc := strict_load(p)) if os.path.exists(p) else ["no file"]
        missing = doc["otherData"]["distgrad"].get("missing") if not probs else None
        if sig == "SIGINT":
            ok = t.get("start") == "ok" and not probs and not missing and res[1]["caught"] >= 1 \
                and not res[1]["tracing_now"]
        else:
            ok = not probs and t.get("start_s", 99) < 20 and t.get("stop_s", 99) < 20 and bool(missing)
        bad += not ok
        print(f"{'PASS' if ok else 'FAIL'} {sig}: tracer {t}; member {res[1]}; file problems {probs[:2]}; missing {missing}")
    print("summary:", "FAIL" if bad else "PASS")
