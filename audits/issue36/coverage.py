"""The critical path on real runs: the two examples (pipeline, parameter server) and a
chain of 3 workers with user spans (one sleeping, one CPU-bound, one long span with
many calls inside and a sleep after them). Checks: coverage >= 95 % of the step, every
stretch has a category, a sleeping span is not computing, and the long span's sleep
is named as the user span, not 'untraced'."""
import json, os, re, subprocess, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import perfetto_problems, run_workers, strict_load
from distgrad.trace.critical import CATEGORIES
from distgrad.trace.summary import report, summarize

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
res = []


def check(path, what):
    doc = strict_load(path)
    probs = perfetto_problems(doc)
    s = summarize(doc)
    text = report(s)
    m = re.search(r"critical path: .* ([\d.]+)% of the step", text)
    cov = float(m.group(1)) if m else 0.0
    cats = {st[4] for st in s.path}
    unnamed = [st for st in s.path if st[4] not in CATEGORIES or not st[3]]
    steps_end = s.path[-1][2] if s.path else 0
    res.append(f"{'PASS' if cov >= 95 and not unnamed else 'FAIL'} {what}: coverage {cov}% "
               f"(path ends at {(steps_end - s.window[0]) / 1e3:.3f} ms of a {(s.window[1] - s.window[0]) / 1e3:.3f} ms window), "
               f"categories {sorted(cats)}, unnamed {unnamed[:2]}")
    res.append(f"{'PASS' if not probs else 'FAIL'} {what}: strict JSON + trace-event fields {probs[:3]}")
    return s, text


def _chain(rank, world_size, path):
    import torch, distgrad, distgrad.rpc as rpc
    if rank != 0:
        return None
    a = torch.ones(64, 64)
    with distgrad.trace(path):
        with distgrad.trace.span("prep (sleeps)"):
            time.sleep(0.2)
        with distgrad.trace.span("cpu work"):
            x = a
            t0 = time.thread_time()
            while time.thread_time() - t0 < 0.1:
                x = torch.mm(a, a)
        with distgrad.trace.span("epoch"):
            for _ in range(100):
                y = rpc.rpc_sync("worker1", torch.mm, args=(a, a))
                rpc.rpc_sync("worker2", torch.add, args=(y, 1))
            time.sleep(0.2)          # inside "epoch", after 100 calls: the user's own wait
        rpc.rpc_sync("worker1", torch.add, args=(a, 1))
    return None


if __name__ == "__main__":
    where = tempfile.mkdtemp(prefix="audit-cov-"); os.chmod(where, 0o700)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for ex, name in (("model_parallel_rnn.py", "pipeline"), ("parameter_server.py", "parameter server")):
        p = os.path.join(where, f"{name.replace(' ', '-')}.json")
        t0 = time.time()
        r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", ex), "--steps", "3", "--trace", p],
                           env=env, capture_output=True, text=True, timeout=150)
        if r.returncode or not os.path.exists(p):
            res.append(f"FAIL {name} example: rc {r.returncode}: {r.stderr[-300:]}")
            continue
        check(p, f"{name} example ({time.time() - t0:.0f} s)")
    p = os.path.join(where, "chain.json")
    run_workers(_chain, world_size=3, timeout=120, args=(p,))
    s, text = check(p, "chain with user spans")
    sh = s.shares["worker0"]
    win = (s.window[1] - s.window[0]) / 1e6
    res.append(f"{'PASS' if sh['computing'] * win < 0.2 else 'FAIL'} the 0.2 s sleeping span is not computing: "
               f"worker0 computing {sh['computing'] * 100:.1f}% of {win:.3f} s ({sh['computing'] * win:.3f} s), idle {sh['idle'] * 100:.1f}%")
    # the sleep at the end of "epoch": the stretch of the path that covers its middle
    sp = {x[2]: x for x in s.spans["worker0"] if x[3].startswith("user")}
    epoch = sp["epoch"]
    mid = epoch[1] - 100_000
    cover = [st for st in s.path if st[0] == "worker0" and st[1] <= mid <= st[2]]
    ok = bool(cover) and cover[0][4] == "user span" and cover[0][3] == "epoch"
    res.append(f"{'PASS' if ok else 'FAIL'} the 0.2 s sleep at the end of 'epoch' (after 200 calls in it) is on the "
               f"path as {[(c[4], c[3], round((c[2] - c[1]) / 1e3, 1)) for c in cover]}")
    for name in ("prep (sleeps)", "cpu work"):
        a, b = sp[name][0], sp[name][1]
        on = sum(st[2] - st[1] for st in s.path if st[3] == name)
        mid = (a + b) / 2
        cover = [(st[4], st[3]) for st in s.path if st[0] == "worker0" and st[1] <= mid <= st[2]]
        ok = abs(on - (b - a)) <= 0.1 * (b - a) and cover and cover[0][1] == name
        res.append(f"{'PASS' if ok else 'FAIL'} span {name!r} ({(b - a) / 1e3:.1f} ms, cpu {sp[name][3]}): "
                   f"{on / 1e3:.1f} ms of the path named after it; its middle is on the path as {cover}")
    print("\n".join(res))
    print("\n".join(text.splitlines()[:9]))
    print("summary:", "FAIL" if any(l.startswith("FAIL") for l in res) else "PASS")
