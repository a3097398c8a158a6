"""``distgrad.trace.schedule``: traces of chosen steps of a long job, as
``torch.profiler.schedule`` (issue 36, beyond torch.profiler). Two spawned workers;
worker0 makes one call per step and lets the schedule open and close the traces."""
from __future__ import annotations

import json
import os

import pytest
import torch
from mp_utils import run_workers, tmp_path_for

pytestmark = pytest.mark.timeout(120)


def _steps(rank, world_size, pattern):
    import distgrad
    import distgrad.rpc as rpc
    if rank != 0:
        return None
    tracing, ready = [], []
    with distgrad.trace.schedule(pattern, wait=2, warmup=1, active=2, repeat=2,
                                 on_trace_ready=ready.append) as sched:
        for i in range(12):
            tracing.append(distgrad.trace.is_tracing())
            rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), i))
            sched.step()
    # repeat=0 and a job that ends inside an active cycle: close() writes it
    tail = distgrad.trace.schedule(pattern.replace("{n}", "tail"), active=5, repeat=0)
    for i in range(2):
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), i))
        tail.step()
    tail.close()
    bad = []
    for kw in ({"active": 0}, {"wait": -1}, {"repeat": 1.5}):
        try:
            distgrad.trace.schedule(pattern, **kw)
        except ValueError as e:
            bad.append(str(e))
    return {"tracing": tracing, "written": sched.written, "ready": ready, "tail": tail.written,
            "bad": bad, "open_after": distgrad.trace.is_tracing()}


def _names(path, cat):
    with open(path) as f:
        doc = json.load(f)
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == cat]


def test_a_schedule_traces_the_steps_it_names_and_nothing_else():
    pattern = tmp_path_for("sched_{n}.json")
    out = run_workers(_steps, world_size=2, timeout=100, args=(pattern,))[0]
    # steps 0,1 wait; 2 warmup; 3,4 active; 5,6 wait; 7 warmup; 8,9 active; then none
    assert out["tracing"] == [False, False, True, True, True, False, False, True, True, True,
                              False, False], out
    assert out["written"] == [pattern.replace("{n}", "0"), pattern.replace("{n}", "1")], out
    assert out["ready"] == out["written"] and out["open_after"] is False, out
    for path, steps in zip(out["written"], ([2, 3, 4], [7, 8, 9])):
        spans = sorted(_names(path, "step"), key=lambda e: e["ts"])
        assert [e["name"] for e in spans] == [f"step {steps[0]} (warmup)", f"step {steps[1]}",
                                              f"step {steps[2]}"], spans
        assert [e["args"]["phase"] for e in spans] == ["warmup", "active", "active"]
        for a, b in zip(spans, spans[1:]):   # one after the other, on the caller's thread
            assert a["ts"] + a["dur"] <= b["ts"] + 1 and a["tid"] == b["tid"]
        # each traced step's call is in the file, and no other step's
        sends = [e for e in _names(path, "rpc.send") if e["args"]["kind"] == "call"
                 and e["args"].get("function", "").endswith("add")]
        assert len(sends) == 3, [e["name"] for e in sends]
    # (no {n} and repeat other than 1: numbered before the extension)
    assert out["tail"] == [pattern.replace("{n}", "tail.0")] and os.path.exists(out["tail"][0])
    assert len(out["bad"]) == 3 and "active must be at least 1" in out["bad"][0], out["bad"]


def _on_signal(rank, world_size, directory):
    import signal
    import time

    import distgrad
    import distgrad.rpc as rpc
    if rank != 0:
        return None
    distgrad.trace.on_signal(os.path.join(directory, "job-{pid}-{time}.json"), seconds=1.0)
    calls, end = 0, None
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30:
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
        calls += 1
        if calls == 20:
            os.kill(os.getpid(), signal.SIGUSR1)   # as `kill -USR1 <pid>` from a shell
            os.kill(os.getpid(), signal.SIGUSR1)   # a second one while capturing: ignored
            end = time.monotonic() + 3
        if end is not None and time.monotonic() > end and not distgrad.trace.is_tracing():
            break
    return {"files": sorted(os.listdir(directory)), "calls": calls}


def test_a_signal_records_the_running_job_for_the_seconds_asked(tmp_path):
    out = run_workers(_on_signal, world_size=2, timeout=100, args=(str(tmp_path),))[0]
    assert len(out["files"]) == 1 and out["files"][0].startswith("job-"), out
    path = os.path.join(str(tmp_path), out["files"][0])
    with open(path) as f:
        doc = json.load(f)
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {"worker0", "worker1"}, names
    calls = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "rpc.serve"
             and e["args"].get("function", "").endswith("add")]
    assert 0 < len(calls) < out["calls"], (len(calls), out)   # the window, not the whole job
    w = doc["otherData"]["distgrad"]["window_us"]
    assert 0.9e6 <= w[1] - w[0] <= 10e6, w


def _fake_start_stop(monkeypatch):
    """distgrad.trace.start/stop replaced: what a schedule opens and closes, no workers."""
    import distgrad.trace as tr
    log = []
    monkeypatch.setattr(tr, "start", lambda path, **kw: log.append(("start", path, kw)))
    monkeypatch.setattr(tr, "stop", lambda: (log.append(("stop",)), "f")[1])
    return log


def test_skip_first_wait_as_torch_and_unknown_start_keywords_refused_at_once(monkeypatch):
    """Third audit (minor): torch 2.13's ``skip_first_wait=`` fell into ``**start_kwargs``
    and every cycle's start failed (only logged); now it has torch's meaning, and a
    keyword start() lacks is refused when the schedule is made."""
    import inspect
    import itertools
    import warnings

    from torch.profiler import ProfilerAction as A
    from torch.profiler import schedule as tsched

    import distgrad.trace as tr
    real_start = tr.start
    log = _fake_start_stop(monkeypatch)
    phases = {A.NONE: "none", A.WARMUP: "warmup", A.RECORD: "active", A.RECORD_AND_SAVE: "active"}
    for wait, warmup, active, repeat, skip, sfw in itertools.product(
            range(3), range(2), range(1, 3), range(3), range(2), (0, 1, True)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            f = tsched(wait=wait, warmup=warmup, active=active, repeat=repeat, skip_first=skip,
                       skip_first_wait=sfw)
        s = tr.schedule("/tmp/t.json", wait=wait, warmup=warmup, active=active, repeat=repeat,
                        skip_first=skip, skip_first_wait=sfw)
        saved = []
        for step in range(30):
            assert s.phase(step) == phases[f(step)], (wait, warmup, active, repeat, skip, sfw, step)
            n = len(s.written)
            s.step()
            if len(s.written) > n:
                saved.append(step)
        assert saved == [st for st in range(30) if f(st) == A.RECORD_AND_SAVE]
        s.close()
    assert all(e[0] == "stop" or e[2] == {} for e in log), log[:3]
    s = tr.schedule("/tmp/t.json", wait=5, active=1, skip_first_wait=True)
    assert s.phase(0) == "active" and s.phase(1) == "none" and log[-1][0] == "start"
    with pytest.raises(TypeError, match="unexpected keyword argument.*no_such"):
        tr.schedule("/tmp/t.json", no_such=1)
    with pytest.raises(ValueError, match="skip_first_wait"):
        tr.schedule("/tmp/t.json", skip_first_wait=-1)
    s = tr.schedule("/tmp/t.json", warmup=1, profile_ops=True, timeout=5.0, max_events=10)
    assert log[-1] == ("start", "/tmp/t.json", {"profile_ops": True, "timeout": 5.0, "max_events": 10})
    from distgrad.trace.schedule import START_KWARGS
    assert list(inspect.signature(real_start).parameters)[1:] == list(START_KWARGS)


def test_the_docs_schedule_example_names_the_steps_it_traces(tmp_path):
    # docs/reading-a-trace.md said wait=999, warmup=1, active=2 traced steps 1000 (warmup) and
    # 1001; steps count from 0, so it is 999 (warmup), 1000 and 1001
    import ast
    import re
    from pathlib import Path

    import distgrad
    doc = (Path(__file__).resolve().parents[1] / "docs" / "reading-a-trace.md").read_text()
    call = re.search(r"distgrad\.trace\.schedule\(\"[^\"]+\", (wait=.*?)\)\n", doc)
    assert call, "the example is gone from the doc"
    kwargs = {k.arg: ast.literal_eval(k.value)
              for k in ast.parse(f"f({call[1]})", mode="eval").body.keywords}
    claim = re.search(r"# steps (\d+) \(warmup\), (\d+) and (\d+) are traced", doc)
    assert claim, "the example's comment no longer names its steps"
    sched = distgrad.trace.schedule(str(tmp_path / "t.json"), **kwargs)
    try:
        upto = kwargs["wait"] + kwargs["warmup"] + kwargs["active"] + 5
        traced = {i: sched.phase(i) for i in range(upto) if sched.phase(i) != "none"}
    finally:
        sched.close()
    warm, a, b = (int(x) for x in claim.groups())
    assert traced == {warm: "warmup", a: "active", b: "active"}, traced
    assert f"`step {warm} (warmup)`, `step {a}`, `step {b}`" in doc
