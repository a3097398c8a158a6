"""distgrad.trace (issue 28): one timeline of a distributed step, on real workers.

The pipeline trace (one fixture, three workers) is recorded with each non-tracing
worker's clock shifted on purpose (DISTGRAD_TRACE_SKEW_NS): the merge must recover
the shifts within the error it states, and still never put an arrival before its
send. Its step: a forward through two stages (rpc_sync, rpc_async, remote),
dist_autograd.backward, DistributedOptimizer.step on both owners, an RRef created
and deleted, user spans.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from mp_utils import SLOW, run_workers, tmp_path_for

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[1]
SKEW_NS = {1: 5_000_000, 2: -7_000_000}   # worker1 +5 ms, worker2 -7 ms


# -- the workers' side ----------------------------------------------------------------
class Stage(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _params(module_rref):
    import distgrad.rpc as rpc
    return [rpc.RRef(p) for p in module_rref.local_value().parameters()]


def _forward(module_rref, x):
    return module_rref.local_value()(x)


def _pipeline(rank, world_size, path):
    import distgrad
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    from distgrad.optim import DistributedOptimizer
    if rank != 0:
        return None
    s1 = rpc.remote("worker1", Stage, args=(1,))
    s2 = rpc.remote("worker2", Stage, args=(2,))
    params = rpc.rpc_sync("worker1", _params, args=(s1,)) + rpc.rpc_sync("worker2", _params, args=(s2,))
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
    x = torch.randn(8, 4)
    calls = Counter()
    with distgrad.trace(path):
        with distgrad.trace.span("step", number=1):
            with dist_autograd.context() as cid:
                with distgrad.trace.span("forward"):
                    h = rpc.rpc_sync("worker1", _forward, args=(s1, x))
                    calls["worker1"] += 1
                    y = rpc.rpc_async("worker2", _forward, args=(s2, h)).wait()
                    calls["worker2"] += 1
                    loss = y.pow(2).mean()
                dist_autograd.backward(cid, [loss])
                opt.step(cid)
                calls["worker1"] += 1
                calls["worker2"] += 1
            extra = rpc.remote("worker1", torch.ones, args=(2,))   # an RRef created ...
            calls["worker1"] += 1
            extra.to_here()
            calls["worker1"] += 1
            del extra                                               # ... and deleted
            gc.collect()
            rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))  # after the fork_del
            calls["worker1"] += 1
    return dict(calls)


_SEEN: list = []


def _record_warnings() -> None:
    """From now on, every warning this process shows is kept in _SEEN (and still shown)."""
    import warnings
    warnings.simplefilter("always")
    shown = warnings.showwarning

    def keep(message, category, filename, lineno, file=None, line=None):
        _SEEN.append((category.__name__, filename, str(message)))
        shown(message, category, filename, lineno, file, line)
    warnings.showwarning = keep


def _seen_warnings() -> list:
    return list(_SEEN)


def _ops(rank, world_size, path):
    import warnings

    import distgrad
    import distgrad.rpc as rpc
    if rank != 0:
        return None
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    rpc.rpc_sync("worker1", _record_warnings)
    _record_warnings()
    rpc.rpc_sync("worker1", torch.matmul, args=(a, b))  # warm
    with distgrad.trace(path, profile_ops=True):
        rpc.rpc_sync("worker1", torch.matmul, args=(a, b))
        warnings.warn("the user's own", UserWarning, stacklevel=1)    # shown: nothing of the user's is hidden
    return {"worker0": _seen_warnings(), "worker1": rpc.rpc_sync("worker1", _seen_warnings)}


def _shapes(rank, world_size, path):
    import distgrad
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    if rank != 0:
        return None
    try:
        distgrad.trace.start(path, profile_ops="yes")
        bad = None
    except ValueError as e:
        bad = str(e)
    w = torch.randn(16, 16, requires_grad=True)
    with distgrad.trace(path, profile_ops="shapes"):
        with dist_autograd.context() as cid:
            h = torch.mm(torch.randn(8, 16), w).relu()
            y = rpc.rpc_sync("worker1", torch.matmul, args=(h, torch.randn(16, 4)))
            dist_autograd.backward(cid, [y.sum()])
    return bad


def _dies(rank, world_size, path):
    import distgrad
    import distgrad.rpc as rpc
    if rank == 0:
        distgrad.trace.start(path, timeout=10)
        rpc.rpc_sync("worker2", torch.add, args=(torch.ones(1), 1))
        rpc.rpc_async("worker2", os._exit, args=(3,))  # worker2 dies mid-trace
        lost, end = rpc.api.current_agent().lost, time.monotonic() + 30
        while 2 not in lost and time.monotonic() < end:   # dead (a sleep only guessed so)
            time.sleep(0.01)
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))
        t0 = time.monotonic()
        distgrad.trace.stop()
        return time.monotonic() - t0
    if rank == 2:
        time.sleep(60)
    return None


def _errors(rank, world_size, path):
    import distgrad
    out = {}
    if rank == 0:
        distgrad.trace.start(path)
        try:
            distgrad.trace.start(path + ".2")
        except RuntimeError as e:
            out["twice"] = str(e)
        distgrad.trace.stop()
        try:
            distgrad.trace.stop()
        except RuntimeError as e:
            out["stop"] = str(e)
    import distgrad.rpc as rpc
    rpc.api._barrier(["worker0", "worker1"])
    if rank == 1:  # worker0's trace is closed: worker1 may open one, and worker0 is traced
        with distgrad.trace(path + ".w1"):
            pass
        distgrad.trace.start(path + ".w1b")
        out["open"] = True
    rpc.api._barrier(["worker0", "worker1"])
    if rank == 0:  # worker1's trace is open: worker0 cannot open another
        try:
            distgrad.trace.start(path + ".3")
        except RuntimeError as e:
            out["busy"] = str(e)
    rpc.api._barrier(["worker0", "worker1"])
    if rank == 1:
        distgrad.trace.stop()
    return out


# -- fixtures -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def pipeline():
    path = tmp_path_for("pipeline.json")
    env = {r: {"DISTGRAD_TRACE_SKEW_NS": str(ns)} for r, ns in SKEW_NS.items()}
    calls = run_workers(_pipeline, world_size=3, timeout=150, args=(path,), env_per_rank=env)[0]
    with open(path) as f:
        return path, json.load(f), calls


def _workers(doc):
    return {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
            if e["ph"] == "M" and e["name"] == "process_name"}


def _spans(doc, cat=None, worker=None):
    names = _workers(doc)
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and (cat is None or e["cat"] == cat)
            and (worker is None or names[e["pid"]] == worker)]


# -- the tests ----------------------------------------------------------------------
def test_the_file_is_valid_trace_event_json(pipeline):
    path, doc, _ = pipeline
    # issue 42, item 5: what it holds (tensor values, names, hosts) is this user's alone
    assert os.stat(path).st_mode & 0o077 == 0, oct(os.stat(path).st_mode)
    assert set(doc) >= {"traceEvents", "otherData"}
    assert doc["traceEvents"], "no events"
    for e in doc["traceEvents"]:
        assert e["ph"] in {"M", "X", "i", "s", "f", "C"}, e
        assert isinstance(e["name"], str) and e["name"], e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "C":   # a counter: one number per series
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values()), e
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        if e["ph"] in ("s", "f"):
            assert isinstance(e["id"], int), e
        if e["ph"] == "f":
            assert e["bp"] == "e", e
        if e["ph"] == "M":
            assert e["name"] in {"process_name", "process_sort_index", "process_labels", "thread_name"}, e
    assert sorted(_workers(doc).values()) == ["worker0", "worker1", "worker2"]
    meta = doc["otherData"]["distgrad"]
    assert meta["tracer"] == "worker0" and meta["missing"] == {}
    named = {(e["pid"], e["tid"]) for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            assert (e["pid"], e["tid"]) in named, f"no thread_name for the track of {e}"


def test_counters_calls_in_flight_queue_depth_and_bytes_per_peer(pipeline):
    """Issue 36, beyond torch.profiler: counter tracks derived from the recording."""
    _, doc, calls = pipeline
    names = _workers(doc)
    series: dict = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "C":
            series.setdefault((names[e["pid"]], e["name"]), []).append((e["ts"], *e["args"].values()))
    flight = [v for _, v in sorted(series[("worker0", "calls in flight")])]
    assert max(flight) >= 1 and flight[-1] == 0 and min(flight) >= 0, flight
    # one rise per call the tracer made and saw answered (its own trace calls excluded)
    assert sum(b > a for a, b in zip([0] + flight, flight)) == sum(calls.values()), (flight, calls)
    for w in ("worker1", "worker2"):   # every request read was then served
        waiting = [v for _, v in sorted(series[(w, "requests waiting")])]
        assert max(waiting) >= 1 and waiting[-1] == 0 and min(waiting) >= 0, (w, waiting)
        sent = series[("worker0", f"sent → {w} (MB/s)")]
        assert max(v for _, v in sent) > 0 and sorted(sent)[-1][1] == 0, sent
    for (w, name), pts in series.items():
        ts = [t for t, _ in pts]
        assert ts == sorted(ts) or name.startswith("sent"), (w, name)


def test_a_served_request_names_its_tensors(pipeline):
    """Issue 36, beyond torch.profiler: payload detail (dtype and shape per tensor)."""
    _, doc, _ = pipeline
    fwd = [e for e in _spans(doc, "rpc.serve", "worker1") if e["args"]["function"].endswith("_forward")]
    assert fwd and all(e["args"]["tensors"] == ["float32[8, 4]"] for e in fwd), fwd
    for e in _spans(doc, "rpc.serve"):
        for t in e["args"].get("tensors", []):
            assert "[" in t and t.split("[")[0] in {"float32", "float64", "int64", "bool"}, e


def test_every_rpc_of_the_step_appears_once_on_each_side_joined_by_its_flow(pipeline):
    _, doc, calls = pipeline
    names = _workers(doc)
    flows = Counter((e["ph"], e["id"]) for e in doc["traceEvents"] if e["ph"] in ("s", "f"))
    assert flows and all(n == 1 for n in flows.values()), [k for k, n in flows.items() if n != 1]
    ids = {i for _, i in flows}
    assert all(("s", i) in flows and ("f", i) in flows for i in ids)
    # every request the driver made shows as a call on worker0, served once on its callee
    made = Counter(e["args"]["to"] for e in _spans(doc, "rpc.call", "worker0"))
    assert made == Counter(calls), (made, calls)
    served = Counter(names[e["pid"]] for e in _spans(doc, "rpc.serve") if e["args"]["from"] == "worker0"
                     and not e["args"]["function"].startswith("distgrad.autograd"))
    assert served == Counter(calls), (served, calls)
    # each send span encloses its flow's start; each receive span its end
    ends = {(e["ph"], e["id"]): e for e in doc["traceEvents"] if e["ph"] in ("s", "f")}
    for ph, cat in (("s", "rpc.send"), ("f", "rpc.recv")):
        spans = _spans(doc, cat)
        for (p, _i), e in ends.items():
            if p == ph:
                assert any(x["pid"] == e["pid"] and x["tid"] == e["tid"] and
                           x["ts"] <= e["ts"] <= x["ts"] + x["dur"] for x in spans), (ph, e)
    # requests and replies: one flow each way per call
    assert sum(1 for e in ends.values() if e["ph"] == "s" and e["name"] == "reply") >= sum(calls.values())


def test_aligned_clocks_never_put_an_arrival_before_its_send(pipeline):
    _, doc, _ = pipeline
    ends = {}
    for e in doc["traceEvents"]:
        if e["ph"] in ("s", "f"):
            ends.setdefault(e["id"], {})[e["ph"]] = e["ts"]
    late = {i: v for i, v in ends.items() if v["f"] < v["s"]}
    assert len(ends) > 10 and not late, late


def test_an_injected_clock_skew_is_recovered_within_the_stated_error(pipeline):
    _, doc, _ = pipeline
    clock = doc["otherData"]["distgrad"]["clock"]
    assert clock["worker0"]["offset_us"] == 0
    for rank, ns in SKEW_NS.items():
        c = clock[f"worker{rank}"]
        assert c["pings"] >= 8 and c["error_us"] > 0, c
        assert abs(c["offset_us"] - ns / 1e3) <= c["error_us"], (rank, c)
        merged = c["offset_us"] + c["causality_shift_us"]
        assert abs(merged - ns / 1e3) <= c["error_us"], (rank, c)


def test_backward_spans_on_every_worker_it_reached(pipeline):
    _, doc, _ = pipeline
    names = _workers(doc)
    runs = {names[e["pid"]] for e in _spans(doc, "backward") if "backward" in e["name"]}
    assert runs == {"worker0", "worker1", "worker2"}, runs
    passes = {names[e["pid"]] for e in _spans(doc, "backward.pass") if "backward" in e["name"]}
    assert passes == {"worker0", "worker1", "worker2"}
    grads = {names[e["pid"]] for e in _spans(doc, "rpc.serve") if e["name"].startswith("serve gradients")}
    assert grads >= {"worker1", "worker2"}
    whole = _spans(doc, "backward.call", "worker0")
    assert len(whole) == 1
    for e in _spans(doc, "backward"):  # every run lies inside the initiator's backward, on one clock
        assert whole[0]["ts"] <= e["ts"] and e["ts"] + e["dur"] <= whole[0]["ts"] + whole[0]["dur"] + 1


def test_the_optimizer_steps_on_each_owner(pipeline):
    _, doc, _ = pipeline
    names = _workers(doc)
    steps = Counter(names[e["pid"]] for e in _spans(doc, "optim"))
    assert steps == Counter({"worker1": 1, "worker2": 1}), steps
    call = _spans(doc, "optim.call", "worker0")
    assert len(call) == 1
    for e in _spans(doc, "optim"):
        assert call[0]["ts"] <= e["ts"] <= call[0]["ts"] + call[0]["dur"]


def test_rref_forks_and_deletes_on_the_owner(pipeline):
    _, doc, _ = pipeline
    names = _workers(doc)
    inst = [(names[e["pid"]], e["name"], e["args"]) for e in doc["traceEvents"] if e["ph"] == "i"]
    forks = [a for w, n, a in inst if w == "worker1" and n == "rref fork" and a["holder"] == "worker0"]
    deletes = [a for w, n, a in inst if w == "worker1" and n == "rref delete" and a["holder"] == "worker0"]
    assert forks and deletes, inst
    assert {a["rref"] for a in deletes} & {a["rref"] for a in forks}
    sent = [e for e in _spans(doc, "rpc.send", "worker0") if "fork_del" in e["name"]]
    assert sent, "the user's fork_del message is not in the trace"


def test_user_spans(pipeline):
    _, doc, _ = pipeline
    user = {e["name"]: e for e in _spans(doc, "user", "worker0")}
    assert set(user) == {"step", "forward"}
    step, fwd = user["step"], user["forward"]
    assert step["args"]["number"] == 1 and set(step["args"]) == {"number", "cpu_us"}, step["args"]
    assert 0 <= step["args"]["cpu_us"] <= step["dur"] + 1000, step
    assert step["ts"] <= fwd["ts"] and fwd["ts"] + fwd["dur"] <= step["ts"] + step["dur"]
    calls = [e for e in _spans(doc, "rpc.call", "worker0") if fwd["ts"] <= e["ts"] <= fwd["ts"] + fwd["dur"]]
    assert len(calls) == 2


def test_trace_plot_draws_the_step_and_prints_the_summary(pipeline):
    path, _, _ = pipeline
    png = tmp_path_for("step.png")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "distgrad", "trace-plot", path, "-o", png],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 10_000
    assert os.stat(png).st_mode & 0o077 == 0, oct(os.stat(png).st_mode)   # (issue 42, item 5)
    text = out.stdout
    assert "critical path" in text and "message" in text, text
    for w in ("worker0", "worker1", "worker2"):
        line = next(ln for ln in text.splitlines() if ln.startswith(w + " "))
        shares = [float(x.rstrip("%")) for x in line.split()[1:5]]
        assert abs(sum(shares) - 100) < 0.5, line
    serving = float(next(ln for ln in text.splitlines() if ln.startswith("worker1 ")).split()[2].rstrip("%"))
    assert serving > 0
    # the critical path covers the step (issue 36): every stretch on it, none left out
    line = next(ln for ln in text.splitlines() if ln.startswith("critical path:"))
    covered = float(line.split("% of the step")[0].rsplit(" ", 1)[1])
    assert covered >= 95, line


@pytest.fixture(scope="module")
def ops_trace():
    path = tmp_path_for("ops.json")
    return path, run_workers(_ops, world_size=2, timeout=120, args=(path,))[0]


def test_profile_ops_warns_nothing_of_its_own(ops_trace):
    # its scan for other profilers read every object's __class__, and torch.distributed's
    # deprecated reduce_op answered each read with a FutureWarning, on every worker
    _, seen = ops_trace
    assert [w for w in seen["worker0"] if w[0] == "UserWarning"] == [
        ("UserWarning", __file__, "the user's own")], seen
    package = str(ROOT / "distgrad") + os.sep
    for worker, got in seen.items():
        assert not [w for w in got if w[0] != "UserWarning" or w[1].startswith(package)], (worker, got)


def test_profile_ops_puts_a_remote_matmul_inside_its_served_span(ops_trace):
    path, _ = ops_trace
    with open(path) as f:
        doc = json.load(f)
    serves = [e for e in _spans(doc, "rpc.serve", "worker1") if e["args"]["function"].endswith("matmul")]
    assert len(serves) == 1
    serve = serves[0]
    mms = [e for e in _spans(doc, "op", "worker1") if e["name"] == "aten::matmul"]
    assert mms, "torch's profiler recorded no aten::matmul on worker1"
    inside = [m for m in mms if m["tid"] == serve["tid"] and serve["ts"] <= m["ts"]
              and m["ts"] + m["dur"] <= serve["ts"] + serve["dur"]]
    assert inside, (serve, mms)
    assert doc["otherData"]["distgrad"]["ops"]["worker1"]["marker_error_us"] < 50
    for w in ("worker0", "worker1"):  # what starting torch's profiler cost, said in the file
        assert 0 < doc["otherData"]["distgrad"]["ops"][w]["start_s"] < 60, doc["otherData"]["distgrad"]["ops"]


def test_profile_ops_shapes_records_input_dims_and_forward_backward_links():
    """Issue 36, beyond torch.profiler: torch's record_shapes and its links from a
    forward op to the backward node it made, on the distgrad timeline."""
    path = tmp_path_for("shapes.json")
    bad = run_workers(_shapes, world_size=2, timeout=150, args=(path,))[0]
    assert bad is not None and "profile_ops must be False, True or 'shapes'" in bad, bad
    with open(path) as f:
        doc = json.load(f)
    mms = [e for e in _spans(doc, "op", "worker1") if e["name"] == "aten::matmul"]
    assert any(e["args"].get("input_dims") == [[8, 16], [16, 4]] for e in mms), mms
    mm0 = [e for e in _spans(doc, "op", "worker0") if e["name"] == "aten::mm"]
    assert any(e["args"].get("input_dims") == [[8, 16], [16, 16]] for e in mm0), mm0
    links = [e for e in doc["traceEvents"] if e.get("cat") == "fwdbwd"]
    assert links and Counter(e["ph"] for e in links)["s"] == Counter(e["ph"] for e in links)["f"]
    ends = {}
    for e in links:
        ends.setdefault(e["id"], {})[e["ph"]] = e
    for pair in ends.values():   # forward first, then its backward, on one worker
        assert pair["s"]["ts"] <= pair["f"]["ts"] and pair["s"]["pid"] == pair["f"]["pid"], pair
    assert doc["otherData"]["distgrad"]["profile_ops"] == "shapes"


def test_a_worker_dying_mid_trace_does_not_hang_the_close():
    path = tmp_path_for("dies.json")
    took = run_workers(_dies, world_size=3, timeout=120, args=(path,), expect_exit={2})[0]
    assert took < 15 * SLOW, took  # a hang guard
    with open(path) as f:
        doc = json.load(f)
    missing = doc["otherData"]["distgrad"]["missing"]
    assert set(missing) == {"worker2"}, missing
    assert sorted(_workers(doc).values()) == ["worker0", "worker1"]
    assert _spans(doc, "rpc.serve", "worker1")


def test_errors_name_the_worker():
    path = tmp_path_for("errors.json")
    out = run_workers(_errors, world_size=2, timeout=120, args=(path,))
    assert "worker0 already has a trace open" in out[0]["twice"], out
    assert "worker0 has no trace open" in out[0]["stop"], out
    busy = out[0]["busy"]
    assert "cannot open a trace" in busy and "worker1 is already recording" in busy, busy
    assert "opened by worker1" in busy, busy
    with open(path + ".w1") as f:
        assert sorted(_workers(json.load(f)).values()) == ["worker0", "worker1"]


def test_start_without_rpc_says_so():
    import distgrad
    with pytest.raises(RuntimeError, match="RPC is not initialized"):
        distgrad.trace.start(tmp_path_for("none.json"))
    with distgrad.trace.span("nothing"):  # no trace open: a span records nothing, costs nothing
        pass
    assert not distgrad.trace.is_tracing()


def test_clock_estimate_and_causality_on_known_numbers(monkeypatch):
    from distgrad.trace import clock
    # three pings (local send, local receive) and what the remote clock read in between:
    # the one with the least round trip (100 ns) wins; its error is half of that
    local = iter([0, 200, 1000, 1100, 2000, 2300])
    remote = iter([1_000_100, 1_001_060, 1_003_000])
    monkeypatch.setattr(clock, "local_ns", lambda: next(local))
    est = clock.estimate(lambda: next(remote), pings=3)
    assert (est.offset_ns, est.error_ns, est.rtt_ns) == (1_000_010, 50, 100)
    # causality: worker1's estimate (+10) would put a message 0->1 (sent 100 on 0, arrived 105
    # on 1) before its send; the closure lowers it to the largest consistent value, +5
    assert clock.keep_causal({0: 0, 1: 10}, [(0, 100, 1, 105)], fixed=0) == {0: 0, 1: 5}
    # a message the other way (sent 200 on 1, arrived 196 on 0) bounds it from below: >= 4
    assert clock.keep_causal({0: 0, 1: 3}, [(1, 200, 0, 196)], fixed=0) == {0: 0, 1: 4}
    assert clock.keep_causal({0: 0, 1: 7}, [(0, 100, 1, 110), (1, 200, 0, 196)], fixed=0) == {0: 0, 1: 7}
