"""Ctrl-C while stop() waits for a member (a member slow to hand over its events: torch's
profiler's stop and export take seconds under profile_ops; here the member's _end is held
3 s by its trace lock). After the KeyboardInterrupt: does the member keep recording a
trace nobody can close (stop() says none is open), and can the user open a new one?
Compared with torch.profiler: an interrupted prof.stop() leaves no profiler running that
blocks the next one. 2 real workers on 127.0.0.1.
Run: cd <repo> && PYTHONPATH=$PWD DISTGRAD_PURE=1 python audits/issue36/interrupted_stop.py"""
import os, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run_workers


def _hold(seconds):
    import threading
    from distgrad.trace import session

    def hold():
        with session._lock:     # the member's _end waits for this, as for a slow profiler stop
            time.sleep(seconds)
    threading.Thread(target=hold, daemon=True).start()


def _run(rank, world_size, where):
    import _thread, threading, torch, distgrad, distgrad.rpc as rpc
    if rank != 0:
        rpc.api._barrier(["worker0", "worker1"])
        return None
    res = []
    distgrad.trace.start(os.path.join(where, "t.json"))
    rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))
    rpc.rpc_sync("worker1", _hold, args=(3.0,))
    threading.Timer(1.0, _thread.interrupt_main).start()
    try:
        distgrad.trace.stop()
        res.append("INFO the interrupt did not reach stop() (stop finished)")
    except KeyboardInterrupt:
        res.append("PASS stop() interrupted by Ctrl-C (the user's KeyboardInterrupt arrives)")
    time.sleep(3.5)   # the member's _end has run or not by now
    member = rpc.rpc_sync("worker1", distgrad.trace.is_tracing)
    res.append(f"{'FAIL' if member else 'PASS'} after the interrupted stop, worker1 still recording: {member}")
    try:
        distgrad.trace.stop()
        res.append("INFO stop() again closed it")
    except Exception as e:  # noqa: BLE001
        res.append(f"INFO stop() again: {str(e)[:90]}")
    try:
        with distgrad.trace(os.path.join(where, "again.json")):
            rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))
        res.append("PASS a new trace opens after the interrupted stop")
    except Exception as e:  # noqa: BLE001
        res.append(f"FAIL a new trace after the interrupted stop: {str(e).splitlines()[0][:200]}")
    n = [rpc.rpc_sync("worker1", _recorded) for _ in range(3)]
    res.append(f"{'FAIL' if n[-1] else 'PASS'} worker1's orphan recorder's events, growing with traffic: {n}")
    rpc.api._barrier(["worker0", "worker1"])
    return res


def _recorded():
    from distgrad.trace import recorder
    return recorder.ACTIVE.recorded if recorder.ACTIVE is not None else 0


if __name__ == "__main__":
    where = tempfile.mkdtemp(prefix="audit-intr-stop-"); os.chmod(where, 0o700)
    lines = run_workers(_run, world_size=2, timeout=90, args=(where,))[0]
    print("\n".join(lines))
    print("summary:", "FAIL" if any(l.startswith("FAIL") for l in lines) else "PASS")
