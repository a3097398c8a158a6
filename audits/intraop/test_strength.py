"""Runs tests/test_intra_op_threads.py's worker program N times and prints, per run,
which of its assertions hold (use with follow_intra_op_threads made a no-op to see
which ones can fail without the change).
    PYTHONPATH=<wt>:<wt>/tests DISTGRAD_PURE=1 python test_strength.py 5
"""
import sys
from mp_utils import run_workers
import test_intra_op_threads as t

if __name__ == "__main__":
    for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
        res = run_workers(t._counts, world_size=2, timeout=90, options={"num_worker_threads": t.THREADS})[0]
        n = res["n"]
        first, second = res["callbacks"]
        print({"distinct_before": len({nm for nm, _ in res["before"]}) == t.THREADS,
               "after_ok": [c for _, c in res["after"]] == [n] * t.THREADS,
               "hooked_ok": res["hooked"] == [n], "callbacks_ok": second == first + 1,
               "after": res["after"], "hooked": res["hooked"], "callbacks": res["callbacks"]}, flush=True)
