"""Runs optim_cases.py under torch and under distgrad (one after the other) and prints
every observation that differs.
    PYTHONPATH=$PWD DISTGRAD_PURE=1 python audits/issue37/optim_diff.py [--jit0] [case ...]"""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run(impl, extra):
    r = subprocess.run([sys.executable, os.path.join(HERE, "optim_cases.py"), "--impl", impl] + extra,
                       capture_output=True, text=True, timeout=600)
    sys.stderr.write("".join(l + "\n" for l in r.stderr.splitlines() if "] case " in l))
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001
        print(f"[{impl}] no result rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
        sys.exit(2)


def main():
    extra = sys.argv[1:]
    got = {impl: run(impl, extra) for impl in ("torch", "distgrad")}
    same = diff = 0
    for rank in sorted(set(got["torch"]) | set(got["distgrad"])):
        a, b = got["torch"].get(rank), got["distgrad"].get(rank)
        if not a or not b or a[0] != "ok" or b[0] != "ok":
            print(f"rank {rank}: torch={a!r:.600} distgrad={b!r:.600}")
            diff += 1
            continue
        for k in sorted(set(a[1]) | set(b[1])):
            va, vb = a[1].get(k), b[1].get(k)
            if va == vb:
                same += 1
                print(f"  same  rank{rank} {k}: {json.dumps(va)[:300]}")
            else:
                diff += 1
                print(f"  DIFF  rank{rank} {k}:\n     torch    = {json.dumps(va)[:900]}\n"
                      f"     distgrad = {json.dumps(vb)[:900]}")
    print(f"{same} same, {diff} differ")


if __name__ == "__main__":
    main()
