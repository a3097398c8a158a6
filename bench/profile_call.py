#!/usr/bin/env python
"""Where the time of one small rpc_sync goes, on the caller and on the callee.

    python bench/profile_call.py [--calls N] [--cprofile] [--top K] [--tensor N]

A fresh 2-worker distgrad cluster (bench/common.run_cluster); worker0 times
``rpc_sync("worker1", torch.add, (ones(16), 1))``. With probes installed on both
workers (perf_counter_ns around each phase's function, wrapped at run time),
it prints per phase the median and p90 in microseconds per call; the probes'
own cost (~0.3 us each) is in every figure. ``--cprofile`` instead runs
cProfile over the calls on the caller's thread and over every callee thread
that reads or serves (one profiler per thread, merged), and prints the top
``K`` functions by own time of each side. Phases whose function no longer
exists (a refactor) are skipped, so the script works on old and new code.
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import threading
import time

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
for _p in (_BENCH_DIR, os.path.dirname(_BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import common  # noqa: E402

# (label, module, attribute path): a function or method wrapped by a timing probe
PHASES = [
    ("caller: pickle (dumps)", "distgrad.rpc.agent", "dumps"),
    ("caller: pickle (dumps)", "distgrad.rpc.fast_path", "dumps"),
    ("caller: frames (encode)", "distgrad.rpc.agent", "encode"),
    ("caller: frames (encode)", "distgrad.rpc.fast_path", "encode_fast"),
    ("both: send (transport.send)", "distgrad.transport.socket_transport", "SocketTransport.send"),
    ("both: read (FrameReader.read)", "distgrad.transport.framing", "FrameReader.read"),
    ("both: dispatch (on_message)", "distgrad.rpc.agent", "RpcAgent.on_message"),
    ("caller: decode reply", "distgrad.rpc.agent", "RpcAgent._decode_reply"),
    ("callee: serve (unpickle+run+reply)", "distgrad.rpc.agent", "RpcAgent._serve"),
    ("callee: unpickle call", "distgrad.rpc.agent", "_load_call"),
    ("callee: run (script.call)", "distgrad.rpc.script", "call"),
    ("callee: reply (pickle+encode+send)", "distgrad.rpc.agent", "RpcAgent._send_reply"),
]

_samples: dict[str, list] = {}
_installed: list = []


def _resolve(mod_name: str, path: str):
    import importlib
    try:
        owner = importlib.import_module(mod_name)
    except ImportError:
        return None, None
    parts = path.split(".")
    for p in parts[:-1]:
        owner = getattr(owner, p, None)
        if owner is None:
            return None, None
    if not hasattr(owner, parts[-1]):
        return None, None
    return owner, parts[-1]


def install_probes() -> list:
    """Wrap every phase's function with a timer (on this worker); returns the labels."""
    pc = time.perf_counter_ns
    done = []
    for label, mod_name, path in PHASES:
        owner, attr = _resolve(mod_name, path)
        if owner is None:
            continue
        fn = getattr(owner, attr)
        if getattr(fn, "_probe", False):
            continue
        bucket = _samples.setdefault(label, [])

        def probe(*a, _fn=fn, _b=bucket, **k):
            s = pc()
            try:
                return _fn(*a, **k)
            finally:
                _b.append(pc() - s)
        probe._probe = True
        setattr(owner, attr, probe)
        _installed.append((owner, attr, fn))
        done.append(label)
    return done


def reset() -> None:
    for v in _samples.values():
        v.clear()


def collect() -> dict:
    out = {}
    for label, v in _samples.items():
        if v:
            s = sorted(v)
            out[label] = (len(s), statistics.median(s) / 1e3, s[int(len(s) * 0.9)] / 1e3)
    return out


# -- cProfile on the callee's threads ---------------------------------------------
_profilers: list = []
_tls = threading.local()


def install_cprofile() -> None:
    import cProfile

    from distgrad.rpc.agent import RpcAgent
    from distgrad.transport.socket_transport import SocketTransport

    def wrap(owner, attr):
        fn = getattr(owner, attr)

        def run(*a, **k):
            if getattr(_tls, "on", False):
                return fn(*a, **k)
            prof = getattr(_tls, "prof", None)
            if prof is None:
                prof = _tls.prof = cProfile.Profile()
                _profilers.append(prof)
            _tls.on = True
            prof.enable()
            try:
                return fn(*a, **k)
            finally:
                prof.disable()
                _tls.on = False
        setattr(owner, attr, run)
    for owner, attr in ((SocketTransport, "_service"), (RpcAgent, "_serve")):
        if hasattr(owner, attr):
            wrap(owner, attr)


def cprofile_report(top: int) -> str:
    import pstats
    if not _profilers:
        return "(no samples)"
    buf = io.StringIO()
    st = pstats.Stats(_profilers[0], stream=buf)
    for p in _profilers[1:]:
        st.add(p)
    st.sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def _calls(rpc, n: int, size: int) -> list:
    import torch
    dst = common.worker_name(1)
    t = torch.ones(size)
    pc = time.perf_counter_ns
    out = []
    for _ in range(n):
        s = pc()
        rpc.rpc_sync(dst, torch.add, args=(t, 1))
        out.append(pc() - s)
    return out


def pin(cpu: int) -> None:
    """Every thread of this process on ``cpu`` (a diagnosis: DG_PIN=1)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except OSError:
            pass


def workload(rpc, n: int, size: int, cprofile: bool, top: int) -> dict:
    import profile_call
    dst = common.worker_name(1)
    if os.environ.get("DG_PIN") == "1":
        pin(0)
        rpc.rpc_sync(dst, profile_call.pin, args=(1,))
    _calls(rpc, 300, size)  # warm up
    res: dict = {}
    if cprofile:
        import cProfile
        import pstats
        rpc.rpc_sync(dst, profile_call.install_cprofile)
        prof = cProfile.Profile()
        prof.enable()
        _calls(rpc, n, size)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        res["caller_cprofile"] = buf.getvalue()
        res["callee_cprofile"] = rpc.rpc_sync(dst, profile_call.cprofile_report, args=(top,))
        return res
    import resource
    r0 = resource.getrusage(resource.RUSAGE_THREAD)
    c1, c0, t0 = rpc.rpc_sync(dst, time.process_time), time.process_time(), time.thread_time()
    plain = sorted(_calls(rpc, n, size))
    t1, c01, c11 = time.thread_time(), time.process_time(), rpc.rpc_sync(dst, time.process_time)
    r1 = resource.getrusage(resource.RUSAGE_THREAD)
    res["cpu_us"] = {"caller thread": (t1 - t0) / n * 1e6, "caller process": (c01 - c0) / n * 1e6,
                     "callee process": (c11 - c1) / n * 1e6,
                     "caller thread user": (r1.ru_utime - r0.ru_utime) / n * 1e6,
                     "caller thread sys": (r1.ru_stime - r0.ru_stime) / n * 1e6,
                     "caller ctx switches vol/invol": (r1.ru_nvcsw - r0.ru_nvcsw) / n * 1000 // 1 / 1000,
                     "invol": (r1.ru_nivcsw - r0.ru_nivcsw) / n}
    res["plain_median_us"] = statistics.median(plain) / 1e3
    res["plain_p99_us"] = plain[int(len(plain) * 0.99)] / 1e3
    labels = rpc.rpc_sync(dst, profile_call.install_probes)
    profile_call.install_probes()
    res["labels"] = labels
    _calls(rpc, 100, size)
    rpc.rpc_sync(dst, profile_call.reset)
    profile_call.reset()
    probed = sorted(_calls(rpc, n, size))
    res["probed_median_us"] = statistics.median(probed) / 1e3
    res["caller"] = profile_call.collect()
    res["callee"] = rpc.rpc_sync(dst, profile_call.collect)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--tensor", type=int, default=16, help="floats in the tensor sent")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    import functools
    fn = functools.partial(workload, n=args.calls, size=args.tensor, cprofile=args.cprofile,
                           top=args.top)
    res = common.run_cluster("distgrad", 2, fn, timeout=600)
    if args.cprofile:
        print("== caller (worker0's thread) ==")
        print(res["caller_cprofile"])
        print("== callee (worker1's reading/serving threads) ==")
        print(res["callee_cprofile"])
        return
    print(f"rpc_sync(torch.add, (ones({args.tensor}), 1)) x {args.calls}: unprobed median "
          f"{res['plain_median_us']:.1f} us, p99 {res['plain_p99_us']:.1f} us; probed median "
          f"{res['probed_median_us']:.1f} us")
    print("CPU per call (us): " + ", ".join(f"{k} {v:.1f}" for k, v in res["cpu_us"].items()))
    print(f"{'phase':44s} {'side':7s} {'n':>6s} {'median us':>10s} {'p90 us':>8s}")
    for side in ("caller", "callee"):
        for label, (n, med, p90) in res[side].items():
            print(f"{label:44s} {side:7s} {n:6d} {med:10.1f} {p90:8.1f}")


if __name__ == "__main__":
    main()
