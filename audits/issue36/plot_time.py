"""trace-plot's time on real traces of 1,500 and 15,000 rpc_sync calls (2 workers), and
a 15,000-call trace with the summary's window checked (the tracer's, not the members')."""
import os, subprocess, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run_workers, strict_load


def _calls(rank, world_size, where):
    import torch, distgrad, distgrad.rpc as rpc
    if rank != 0:
        return None
    one = torch.ones(2)
    for n in (1500, 15000):
        with distgrad.trace(os.path.join(where, f"calls{n}.json")):
            for _ in range(n):
                rpc.rpc_sync("worker1", torch.add, args=(one, 1))
    return None


if __name__ == "__main__":
    where = tempfile.mkdtemp(prefix="audit-time-"); os.chmod(where, 0o700)
    t0 = time.time()
    run_workers(_calls, world_size=2, timeout=170, args=(where,))
    print(f"recorded in {time.time() - t0:.0f} s")
    times, res = {}, []
    for n in (1500, 15000):
        p = os.path.join(where, f"calls{n}.json")
        t = time.time()
        r = subprocess.run([sys.executable, "-m", "distgrad", "trace-plot", p, "-o", p + ".png"],
                           capture_output=True, text=True, timeout=170)
        times[n] = time.time() - t
        size = os.path.getsize(p) / 2**20
        res.append(f"{'PASS' if r.returncode == 0 and times[n] < 60 else 'FAIL'} trace-plot on {n} calls "
                   f"({size:.1f} MiB): {times[n]:.1f} s wall, rc {r.returncode} {r.stdout.splitlines()[0][:90] if r.stdout else r.stderr[-200:]}")
        meta = strict_load(p)["otherData"]["distgrad"]
        win = meta["window_us"]
        res.append(f"INFO window {win[1] - win[0]:.0f} µs; windows {meta['windows_us']}")
    ratio = (times[15000] - 3) / max(times[1500] - 3, 0.5)
    res.append(f"{'PASS' if ratio < 15 else 'FAIL'} 10x the calls: {ratio:.1f}x the time (less ~3 s of start-up)")
    print("\n".join(res))
    print("summary:", "FAIL" if any(l.startswith("FAIL") for l in res) else "PASS")
