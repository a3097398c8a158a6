"""What trace-plot and the summary say (issue 36): on recordings made up here, so each
rule is checked on numbers known in advance, without workers.

A made-up recording goes through the real merge (:func:`distgrad.trace.export.build`)
and then the summary, as a file from real workers does.
"""
from __future__ import annotations

import argparse
import json
import time
import types

import pytest
from mp_utils import tmp_path_for

US = 1000  # ns


def _fid(rank, rid, reply):
    return ((rank + 1) << 41) | (rid << 1) | reply


def _doc(workers, tracer=0, missing=None):
    """``workers``: rank -> (events in µs, (started, stopped) µs) -> the merged document."""
    from distgrad.trace import export
    from distgrad.trace.clock import Offset
    payloads = {}
    for rank, (events, (started, stopped)) in workers.items():
        ns = []
        for e in events:
            if e[0] == "X":
                ph, name, cat, tid, a, b, args = e
                ns.append((ph, name, cat, tid, a * US, b * US, args))
            elif e[0] in ("s", "f"):
                ph, fid, tid, t, name = e
                ns.append((ph, fid, tid, t * US, name))
            elif e[0] == "i":
                ph, name, cat, tid, t, args = e
                ns.append((ph, name, cat, tid, t * US, args))
            elif e[0] == "L":   # torch's link from a forward op to its backward node (profile_ops)
                ph, i, (stid, st), (ftid, ft) = e
                ns.append((ph, i, (stid, st * US), (ftid, ft * US)))
        payloads[rank] = {"rank": rank, "name": f"worker{rank}", "pid": 100 + rank, "host": "h", "events": ns,
                          "threads": {}, "started_ns": started * US, "stopped_ns": stopped * US}
    session = types.SimpleNamespace(missing=dict(missing or {}), profile_ops=False, max_events=1000)
    return export.build(tracer, payloads, {r: Offset(0, 0, 0, 1) for r in payloads}, session)


def test_shares_are_of_the_tracing_workers_window():
    doc = _doc({0: ([("X", "rpc_sync f → worker1", "rpc.call", 7, 100, 200, {})], (100, 200)),
                1: ([("X", "serve early", "rpc.serve", 8, 10, 60, {}),
                     ("X", "serve f", "rpc.serve", 8, 120, 180, {}),
                     ("X", "serve late", "rpc.serve", 8, 250, 290, {})], (0, 300))})
    from distgrad.trace import summary
    s = summary.summarize(doc)
    assert s.window[1] - s.window[0] == pytest.approx(100), s.window
    assert s.shares["worker0"]["idle"] == pytest.approx(0), s.shares
    assert s.shares["worker1"]["serving"] == pytest.approx(0.6), s.shares


def test_a_user_span_counts_as_computing_only_where_its_thread_ran():
    doc = _doc({0: ([("X", "sleepy", "user", 7, 0, 500, {"cpu_us": 5.0}),
                     ("X", "busy", "user", 7, 500, 600, {"cpu_us": 95.0})], (0, 600))})
    from distgrad.trace import summary
    s = summary.summarize(doc)
    assert s.shares["worker0"]["computing"] == pytest.approx(100 / 600), s.shares
    assert s.shares["worker0"]["idle"] == pytest.approx(500 / 600), s.shares


def test_a_span_records_its_threads_cpu_time(monkeypatch):
    import distgrad
    from distgrad import observe
    got = []
    fake = types.SimpleNamespace(span=lambda name, cat, t0, args: got.append((name, dict(args))))
    monkeypatch.setattr(observe, "ACTIVE", fake)
    with distgrad.trace.span("sleeps", n=1):
        time.sleep(0.05)
    end = time.thread_time() + 0.05
    with distgrad.trace.span("spins"):
        while time.thread_time() < end:
            pass
    (_, sleeps), (_, spins) = got
    assert sleeps["n"] == 1 and sleeps["cpu_us"] < 20_000, sleeps
    assert spins["cpu_us"] >= 40_000, spins


def _step(links=()):
    """worker0 calls f on worker1 (its request queued there behind another thread's
    serving), then runs untraced code inside its user span, then a backward run;
    ``links``: torch's forward-to-backward links recorded on worker1 (profile_ops)."""
    req, rep = _fid(0, 1, 0), _fid(0, 1, 1)
    w0 = [("X", "step", "user", 7, 0, 1000, {"cpu_us": 900.0}),
          ("X", "rpc_sync f → worker1", "rpc.call", 7, 100, 150, {}), ("s", req, 7, 140, "request"),
          ("X", "wait f ← worker1", "rpc.wait", 7, 150, 640, {}),
          ("X", "recv reply f ← worker1", "rpc.recv", 7, 600, 620, {"from": "worker1", "rid": 1,
                                                                     "kind": "reply"}),
          ("f", rep, 7, 600, "reply"),
          ("X", "backward run", "backward", 7, 900, 950, {})]
    w1 = [("X", "recv f ← worker0", "rpc.recv", 8, 200, 210, {"from": "worker0", "rid": 1, "kind": "call"}),
          ("f", req, 8, 200, "request"),
          ("X", "serve gradients ← worker0", "rpc.serve", 10, 250, 520, {"from": "worker0", "rid": 99}),
          ("X", "serve f ← worker0", "rpc.serve", 9, 300, 500, {"from": "worker0", "rid": 1}),
          ("X", "send reply f → worker0", "rpc.send", 9, 480, 500, {}), ("s", rep, 9, 490, "reply")]
    return _doc({0: (w0, (0, 1000)), 1: (w1 + list(links), (0, 1000))})


def test_the_critical_path_covers_the_step_and_names_each_stretch():
    from distgrad.trace import summary
    s = summary.summarize(_step())
    path = s.path
    assert path[0][1] == pytest.approx(s.window[0]) and path[-1][2] == pytest.approx(s.window[0] + 950)
    for a, b in zip(path, path[1:]):  # no holes: each stretch starts where the one before ended
        assert b[1] == pytest.approx(a[2]), (a, b)
    got = [(w, round(b - a), label, cat) for w, a, b, label, cat in path]
    assert got == [
        ("worker0", 100, "step", "user span"),
        ("worker0", 40, "rpc_sync f → worker1", "network"),
        ("worker1", 60, "message worker0 → worker1", "network"),
        ("worker1", 10, "recv f ← worker0", "network"),
        ("worker1", 90, "queued before serve f ← worker0", "queueing"),
        ("worker1", 190, "serve f ← worker0", "serve"),   # not the other thread's gradients
        ("worker0", 110, "message worker1 → worker0", "network"),
        ("worker0", 20, "recv reply f ← worker1", "network"),
        ("worker0", 20, "wait f ← worker1", "waiting"),   # the wait ends after the reply's read
        ("worker0", 260, "step", "user span"),
        ("worker0", 50, "backward run", "compute")], got
    text = summary.report(s)
    assert "100.0% of the step" in text, text
    assert ("on it: user span 0.360 ms, network 0.240 ms, serve 0.190 ms, queueing 0.090 ms, "
            "compute 0.050 ms, waiting 0.020 ms") in text, text


def test_a_gap_across_two_user_spans_is_named_after_each():
    # audit of issue 36 (coverage.py): the whole gap was named after the span at its middle
    from distgrad.trace import summary
    w0 = [("X", "prep (sleeps)", "user", 7, 0, 200, {"cpu_us": 1.0}),
          ("X", "cpu work", "user", 7, 200, 300, {"cpu_us": 99.0}),
          ("X", "backward run", "backward", 7, 300, 350, {})]
    s = summary.summarize(_doc({0: (w0, (0, 350))}))
    got = [(round(b - a), label, cat) for _, a, b, label, cat in s.path]
    assert got == [(200, "prep (sleeps)", "user span"), (100, "cpu work", "user span"),
                   (50, "backward run", "compute")], got


def test_a_sleep_in_a_span_after_many_spans_is_named_after_it():
    # audit of issue 36 (coverage.py): a span more than 64 spans back was not found
    from distgrad.trace import summary
    w0 = [("X", "epoch", "user", 7, 0, 100_000, {"cpu_us": 1.0})]
    w0 += [("X", f"region {i}", "backward.region", 7, i * 50, i * 50 + 10, {}) for i in range(600)]
    w0 += [("X", "backward run", "backward", 7, 90_000, 90_050, {})]
    s = summary.summarize(_doc({0: (w0, (0, 100_000))}))
    sleep = [st for st in s.path if st[1] <= s.window[0] + 60_000 <= st[2]]
    assert [(round(b - a), label, cat) for _, a, b, label, cat in sleep] == \
        [(90_000 - 29_960, "epoch", "user span")], sleep


def _many_calls(n):
    """A made-up trace of ``n`` rpc_sync calls from worker0 to workers 1 and 2, in turn."""
    w = {0: [], 1: [], 2: []}
    for i in range(n):
        t, peer, rid = i * 100, 1 + i % 2, i + 1
        req, rep = _fid(0, rid, 0), _fid(0, rid, 1)
        w[0] += [("X", "rpc_sync add → w", "rpc.call", 7, t, t + 20, {}), ("s", req, 7, t + 15, "request"),
                 ("X", "wait add", "rpc.wait", 7, t + 20, t + 90, {}),
                 ("X", "recv reply add", "rpc.recv", 7, t + 80, t + 85, {"from": f"worker{peer}", "rid": rid,
                                                                          "kind": "reply"}),
                 ("f", rep, 7, t + 80, "reply")]
        w[peer] += [("X", "recv add", "rpc.recv", 8, t + 30, t + 35, {"from": "worker0", "rid": rid,
                                                                       "kind": "call"}),
                    ("f", req, 8, t + 30, "request"),
                    ("X", "serve add", "rpc.serve", 9, t + 40, t + 70, {"from": "worker0", "rid": rid}),
                    ("s", rep, 9, t + 65, "reply")]
    return _doc({r: (evs, (0, n * 100)) for r, evs in w.items()})


def test_the_summary_is_linear_in_the_trace():
    from distgrad.trace import summary
    times = {}
    for n in (1500, 6000):
        doc = _many_calls(n)
        t0 = time.process_time()
        s = summary.summarize(doc)
        summary.report(s)
        times[n] = time.process_time() - t0
        assert times[1500] < 4, times   # 726a179: 11-20 s (quadratic); now ~0.2 s
        assert len(s.messages) == 2 * n
        cover = sum(b - a for _, a, b, _, _ in s.path) / (s.path[-1][2] - s.window[0])
        assert cover > 0.99, cover
    assert times[6000] < 8 * times[1500] + 1, times   # 4x the calls: far from 16x


def _raw(events, end):
    """A trace file's document as trace-plot reads it: worker0's events (µs), no merge
    (a merge would move partly overlapping user spans to tracks of their own)."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "w0"}}]
    xs = [{"ph": "X", "pid": 1, "tid": 7, "ts": ts, "dur": dur, "name": name, "cat": cat, "args": {}}
          for ts, dur, name, cat in events]
    about = {"tracer": "w0", "window_us": [0, end], "workers": {"w0": {"rank": 0}}}
    return {"traceEvents": meta + xs, "otherData": {"distgrad": about}}


def _summary_seconds(events, end):
    from distgrad.trace import summary
    t0 = time.process_time()
    s = summary.summarize(_raw(events, end))
    took = time.process_time() - t0
    last = max(ts + dur for ts, dur, _, cat in events if cat == "rpc.call")
    assert s.path and s.path[-1][2] == last, s.path[-3:]   # the path reaches the last call
    return took


def test_the_critical_path_is_linear_under_deep_nesting_and_on_a_staircase():
    """The second audit of issue 36 (critical_overlap.py): naming each gap of the
    critical path walked every enclosing span, so 15,000 calls under 2,000 nested spans
    took 23 s, and spans that overlap partly on one thread (asyncio coroutines, each in
    a span around an await: a staircase) were quadratic (15,000: 17 s)."""
    depth, n = 2000, 6000
    end = 2 * (depth + 10 * n + 10)
    calls = [(depth + 10 * k, 2, "rpc_sync f → w0", "rpc.call") for k in range(n)]
    flat = _summary_seconds([(0, end, "level 0", "user")] + calls, end)
    nested = _summary_seconds([(i, end - 2 * i, f"level {i}", "user") for i in range(depth)] + calls, end)
    # the same calls under one span and under 2,000: before, 2.5 s against 0.07 s
    assert nested < 4 * flat + 0.3, (flat, nested)

    def staircase(n):
        ev = [(10 * k, 5000, f"coroutine {k}", "user") for k in range(n)]
        ev += [(10 * k + 5, 2, "rpc_async f → w0", "rpc.call") for k in range(n)]
        return ev, 10 * n + 5000
    small, large = _summary_seconds(*staircase(3000)), _summary_seconds(*staircase(12000))
    # 4x the spans: linear 4x, quadratic 16x (before: 0.5 s and 4 s; now 0.13 s and 0.2 s)
    assert large < 5 * small + 0.3, (small, large)


_OURS = '"otherData":{"distgrad":{}},'


@pytest.mark.parametrize("content, why", [
    ('{' + _OURS + '"traceEvents":[{"ph":"X","cat":"rpc.serve","name":"x","pid":1,"tid":1,"ts":"0",'
     '"dur":1}]}', "a time that is not a number"),
    ('{"traceEvents": 3}', "no list of traceEvents"), ("[1, 2]", "no list of traceEvents"),
    ("not json at all", "Expecting value"), ('{' + _OURS + '"traceEvents":[7]}', "#0 is not an object"),
    ('{"traceEvents":[]}', "a trace another tool wrote, not distgrad.trace's")])
def test_trace_plot_says_in_one_line_what_is_wrong_with_a_bad_file(content, why, capsys):
    from distgrad.trace import plot
    path = tmp_path_for("bad.json")
    with open(path, "w") as f:
        f.write(content)
    rc = plot.main(argparse.Namespace(trace=path, output=tmp_path_for("bad.png"), title=None))
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 1 and len(out) == 1, out
    assert out[0].startswith(f"distgrad trace-plot: cannot read {path} as a distgrad trace: "), out
    assert why in out[0], out


def test_trace_plot_refuses_a_torch_profiler_trace(tmp_path):
    # it used to draw an empty picture and exit 0
    import os
    import subprocess
    import sys
    from pathlib import Path

    import torch
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    path, png = tmp_path / "torch.json", tmp_path / "torch.png"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(4).add_(1).sum()
    prof.export_chrome_trace(str(path))
    with open(path) as f:
        assert json.load(f)["traceEvents"], "torch wrote no events: the check would be empty"
    done = subprocess.run([sys.executable, "-m", "distgrad", "trace-plot", str(path), "-o", str(png)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout.strip() == (
        f"distgrad trace-plot: cannot read {path} as a distgrad trace: a torch.profiler trace, not "
        "distgrad.trace's (it has no otherData.distgrad); open it at https://ui.perfetto.dev, or "
        "record with distgrad.trace(path)"), done.stdout
    assert not png.exists()


def test_torchs_forward_to_backward_links_are_not_messages():
    # profile_ops: torch's links from a forward op to its backward node, on one worker, were
    # counted as messages ("message stage1 → stage1" topped a critical path)
    from distgrad.trace import summary
    plain = summary.summarize(_step())
    doc = _step(links=[("L", 1, (9, 310), (10, 400)), ("L", 2, (9, 320), (8, 480))])
    assert sum(1 for e in doc["traceEvents"] if e.get("cat") == "fwdbwd") == 4, "no links drawn"
    linked = summary.summarize(doc)
    assert len(linked.messages) == len(plain.messages) == 2
    assert {(m[0], m[2]) for m in linked.messages} == {("worker0", "worker1"), ("worker1", "worker0")}
    assert linked.path == plain.path
    assert not any(label == "message worker1 → worker1" for _, _, _, label, _ in linked.path)
    assert summary.report(linked).splitlines()[0].endswith(", 2 workers, 2 messages")


def test_concurrent_backward_passes_get_a_track_each():
    def run(key, a, b):
        return ("X", "backward run (roots)", "backward", 7, a, b, {"pass": key})
    doc = _doc({0: ([run("0.1", 0, 100), run("0.2", 50, 150), run("0.1", 120, 130), run("0.3", 160, 200)],
                    (0, 200))})
    passes = [e for e in doc["traceEvents"] if e.get("cat") == "backward.pass"]
    assert len(passes) == 3, passes
    by_track: dict = {}
    for e in passes:
        by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_track.values():  # on one track, spans never partly overlap
        spans.sort()
        assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:])), spans
    assert len(by_track) == 2
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert sorted(names[t] for _, t in by_track) == ["backward passes", "backward passes (2)"], names


def test_partly_overlapping_user_spans_of_one_thread_get_tracks_that_nest():
    """asyncio coroutines on one thread, each in its own span (the second audit of
    issue 36): on one track they would overlap partly, which Perfetto cannot draw."""
    def user(name, a, b):
        return ("X", name, "user", 7, a, b, {})
    doc = _doc({0: ([user("c0", 0, 100), user("c1", 10, 120), user("c2", 20, 60), user("inner", 30, 40),
                     user("c3", 110, 130), ("X", "rpc_sync f → worker1", "rpc.call", 7, 12, 14, {})],
                    (0, 130))})
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    by_track: dict = {}
    for e in xs:
        by_track.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for spans in by_track.values():   # on each track, spans nest or follow each other
        spans.sort(key=lambda x: (x[0], -x[1]))
        stack: list = []
        for a, b, name in spans:
            while stack and stack[-1] <= a:
                stack.pop()
            assert not stack or b <= stack[-1], (name, spans)
            stack.append(b)
    assert sorted(n for a, b, n in by_track[7]) == ["c0", "c2", "c3", "inner", "rpc_sync f → worker1"]
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    moved = [t for t in by_track if t != 7]
    assert [sorted(n for a, b, n in by_track[t]) for t in moved] == [["c1"]]
    assert names[moved[0]].endswith("spans (2)"), names


def test_a_garbage_collection_on_the_path_is_named_a_pause_not_a_wait():
    doc = _doc({0: ([("X", "rpc_sync f → worker1", "rpc.call", 7, 0, 10, {}),
                     ("X", "wait f ← worker1", "rpc.wait", 7, 10, 300, {}),
                     ("i", "gc pause (gen 2)", "gc", 7, 20, {"generation": 2, "pause_us": 250.0}),
                     ("X", "backward run", "backward", 7, 300, 310, {})], (0, 310))})
    from distgrad.trace import summary
    s = summary.summarize(doc)
    got = [(round(a), round(b), label, cat) for _, a, b, label, cat in s.path]
    assert (20, 270, "gc pause during wait f ← worker1", "gc pause") in got, got
    assert "garbage collections: 1, 0.250 ms in all" in summary.report(s)


def test_the_picture_shows_phases_threads_span_names_failures_and_a_missing_worker(monkeypatch, tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from distgrad.trace import plot, summary
    doc = _doc({0: ([("X", "step", "user", 7, 0, 1000, {"cpu_us": 900.0}),
                     ("X", "dist_autograd.backward", "backward.call", 7, 100, 400, {}),
                     ("X", "DistributedOptimizer.step", "optim.call", 7, 500, 900, {}),
                     ("X", "recv error f ← worker1", "rpc.recv", 7, 950, 960, {"kind": "error"})], (0, 1000)),
                1: ([("X", "serve gradients ← worker0", "rpc.serve", 8, 100, 400, {}),
                     ("X", "serve step ← worker0", "rpc.serve", 9, 200, 800, {})], (0, 1000))},
               missing={"worker2": "no events gathered: WorkerLostError"})
    s = summary.summarize(doc)
    figs = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figs.append(self))
    monkeypatch.setattr("matplotlib.pyplot.close", lambda fig=None: None)
    plot.draw(s, str(tmp_path / "unused.png"), "t")
    ax = figs[0].axes[0]
    texts = [t.get_text() for t in ax.texts]
    for name in ("step", "dist_autograd.backward", "DistributedOptimizer.step", "serve gradients ← worker0",
                 "serve step ← worker0"):
        assert name in texts, (name, texts)
    assert any(t.startswith("worker2 missing: no events gathered") for t in texts), texts
    rows = [t.get_text().strip() for t in ax.get_yticklabels()]
    assert [r.split("\n")[0] for r in rows] == ["worker0", "thread 7", "worker1", "thread 9", "thread 8",
                                                "worker2"], rows
    assert plot.failures(s) == [("worker0", s.window[0] + 950)]


def test_torch_ops_outside_the_tracing_workers_window_are_left_out_and_counted():
    def op(name, a, b):
        return ("X", name, "op", 20, a, b, {"torch_cat": "cpu_op"})
    doc = _doc({0: ([("X", "rpc_sync f → worker1", "rpc.call", 7, 1000, 1100, {})], (1000, 1200)),
                1: ([op("aten::before", 10, 20), op("aten::inside", 1050, 1060),
                     op("aten::across", 990, 1010), op("aten::after", 1300, 1310)], (0, 1400))})
    ops = sorted(e["name"] for e in doc["traceEvents"] if e.get("cat") == "op")
    assert ops == ["aten::across", "aten::inside"], ops
    assert doc["otherData"]["distgrad"]["ops"]["worker1"]["outside_window"] == 2


def test_a_trace_with_a_thread_per_span_is_summarized_in_linear_time():
    # a crafted file: 2,000 calls, every span on a thread of its own (a look-up per thread
    # per step would be quadratic)
    from distgrad.trace import summary
    w0, w1 = [], []
    for i in range(2000):
        t, rid = i * 100, i + 1
        req, rep = _fid(0, rid, 0), _fid(0, rid, 1)
        w0 += [("X", "rpc_sync f → worker1", "rpc.call", 10_000 + i, t, t + 20, {}),
               ("s", req, 10_000 + i, t + 10, "request"), ("f", rep, 50_000 + i, t + 90, "reply"),
               ("X", "recv reply f", "rpc.recv", 50_000 + i, t + 90, t + 95, {})]
        w1 += [("X", "serve f", "rpc.serve", 90_000 + i, t + 40, t + 70, {"from": "worker0", "rid": rid}),
               ("f", req, 90_000 + i, t + 30, "request"), ("s", rep, 90_000 + i, t + 60, "reply")]
    doc = _doc({0: (w0, (0, 200_000)), 1: (w1, (0, 200_000))})
    t0 = time.process_time()
    s = summary.summarize(doc)
    took = time.process_time() - t0
    assert took < 4, took
    assert len(s.messages) == 4000 and s.path[-1][2] > s.path[0][1]


def test_control_messages_get_flows_so_the_path_follows_the_end_of_a_backward():
    # worker1 reports the end of its backward run twice; worker0 (the tracer) started
    # recording after the first left, so only the second pairs with worker0's receive
    def send(t):
        return ("X", "send control ag_report → worker0", "rpc.send", 8, t, t + 5,
                {"to": "worker0", "kind": "control", "function": "control ag_report", "bytes": 50, "rid": 0})
    doc = _doc({0: ([("X", "dist_autograd.backward", "backward.call", 7, 100, 400, {}),
                     ("X", "recv control ag_report ← worker1", "rpc.recv", 7, 380, 390,
                      {"from": "worker1", "kind": "control", "bytes": 50})], (100, 400)),
                1: ([send(50), ("X", "backward run", "backward", 8, 200, 330, {}), send(320)], (0, 400))})
    flows = [e for e in doc["traceEvents"] if e["ph"] in ("s", "f") and e["name"] == "control"]
    # (the file's time axis starts at the first event, worker1's send at 50)
    assert sorted((e["ph"], e["ts"]) for e in flows) == [("f", 330.0), ("s", 270.0)], flows
    from distgrad.trace import summary
    s = summary.summarize(doc)
    labels = [(w, label) for w, _, _, label, _ in s.path]
    assert ("worker0", "message worker1 → worker0") in labels, labels
    assert ("worker1", "backward run") in labels, labels
