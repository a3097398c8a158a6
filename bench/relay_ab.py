#!/usr/bin/env python
"""A/B of two checkouts on the relay's backward (distgrad only), fresh clusters, alternated.

    python bench/relay_ab.py TREE_A TREE_B [--n 16] [--seconds 3] [--repeats 5]

Each run puts one checkout first on ``PYTHONPATH`` (its compiled modules with it) and
runs ``bench/relay_backward.py``'s ``drive`` on a fresh 3-worker cluster; the order
alternates every repeat. Printed: each run's backward median and the load average, then
the median of the runs per checkout.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = r'''
import functools, json, os, sys
sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"], "bench"))
import common, relay_backward as rb
r = common.run_cluster("distgrad", 3, functools.partial(rb.drive, n=%d, seconds=%f), timeout=300,
                       num_worker_threads=4)
print("RESULT", json.dumps(r))
'''


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    res: dict = {args.a: [], args.b: []}
    print("load before", os.getloadavg(), flush=True)
    for i in range(args.repeats):
        for tree in ((args.a, args.b) if i % 2 == 0 else (args.b, args.a)):
            out = subprocess.run([sys.executable, "-c", _CHILD % (args.n, args.seconds)],
                                 env=dict(os.environ, PYTHONPATH=tree), capture_output=True, text=True,
                                 timeout=400, cwd=tree)
            line = [s for s in out.stdout.splitlines() if s.startswith("RESULT")]
            if not line:
                sys.exit(out.stdout[-2000:] + out.stderr[-3000:])
            r = json.loads(line[0][7:])
            res[tree].append(r["backward_ms"])
            print(f"{tree}: backward {r['backward_ms']:.3f} ms exit {r['exit_ms']:.3f} steps {r['steps']}"
                  f"  load {os.getloadavg()[0]:.2f}", flush=True)
    for tree, v in res.items():
        print(f"MEDIAN {tree}: {statistics.median(v):.3f} ms  all {[round(x, 3) for x in v]}")


if __name__ == "__main__":
    main()
