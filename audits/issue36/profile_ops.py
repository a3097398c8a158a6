"""profile_ops with and without a user's torch.profiler: (1) alone: torch's ops merged,
strict JSON, and the user can profile afterwards on both workers; (2) a user's profiler
held by another thread of the tracer; (3) a user's scheduled profiler
(torch.profiler.schedule) in its 'wait' phase when the trace opens, stepping into
'warmup'/'active' while the trace is open."""
import os, sys, tempfile, threading, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import perfetto_problems, run_workers, strict_load


def _profile_after():
    import torch
    with torch.profiler.profile() as prof:
        torch.mul(torch.ones(2), 3)
    return sorted({e.name for e in prof.events() if e.name == "aten::mul"})


def _run(rank, world_size, where, stage):
    import torch, distgrad, distgrad.rpc as rpc
    if rank != 0:
        return None
    res = []
    one = torch.ones(8, 8)

    def say(ok, what):
        res.append(f"{'PASS' if ok else 'FAIL'} {what}")
    if stage == 1:
        return _stage12(res, say, one, where, torch, distgrad, rpc)
    return _stage3(res, say, one, where, torch, distgrad, rpc)


def _stage12(res, say, one, where, torch, distgrad, rpc):
    p = os.path.join(where, "ops.json")
    t0 = time.time()
    with distgrad.trace(p, profile_ops=True):
        rpc.rpc_sync("worker1", torch.mm, args=(one, one))
    doc = strict_load(p)
    probs = perfetto_problems(doc)
    ops = [e for e in doc["traceEvents"] if e.get("cat") == "op"]
    meta = doc["otherData"]["distgrad"]["ops"]
    say(ops and not probs, f"profile_ops alone: {len(ops)} torch ops, {time.time() - t0:.1f} s, meta {meta}, problems {probs[:3]}")
    say(_profile_after() == ["aten::mul"] and rpc.rpc_sync("worker1", _profile_after) == ["aten::mul"],
        "the user profiles on both workers after a profile_ops trace")
    # 2
    started, done = threading.Event(), threading.Event()

    def holder():
        with torch.profiler.profile() as prof:
            torch.sub(torch.ones(2), 1)
            started.set()
            done.wait(30)
            torch.div(torch.ones(2), 2)
        holder.names = sorted({e.name for e in prof.events() if e.name in ("aten::sub", "aten::div")})
    th = threading.Thread(target=holder); th.start(); started.wait(30)
    try:
        with distgrad.trace(os.path.join(where, "ops2.json"), profile_ops=True):
            rpc.rpc_sync("worker1", torch.mm, args=(one, one))
        refused = None
    except RuntimeError as e:
        refused = str(e)
    done.set(); th.join(30)
    say(refused is not None and getattr(holder, "names", None) == ["aten::div", "aten::sub"],
        f"a user's profiler on another thread: refused {bool(refused)}, the user's profile kept {getattr(holder, 'names', None)}")
    return res


def _stage3(res, say, one, where, torch, distgrad, rpc):
    from torch.profiler import profile, schedule
    got = {}
    prof = profile(schedule=schedule(wait=1, warmup=1, active=2, repeat=1),
                   on_trace_ready=lambda p: got.setdefault("names", sorted({e.name for e in p.events() if e.name == "aten::mm"})))
    prof.start()
    err = None
    try:
        with distgrad.trace(os.path.join(where, "ops3.json"), profile_ops=True):
            for _ in range(5):
                torch.mm(one, one)
                rpc.rpc_sync("worker1", torch.add, args=(one, 1))
                prof.step()
        prof.stop()
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {str(e)[:150]}"
        try:
            prof.stop()
        except Exception:  # noqa: BLE001
            pass
    ok3 = err is None and os.path.exists(os.path.join(where, "ops3.json")) and got.get("names") == ["aten::mm"]
    note = ""
    if os.path.exists(os.path.join(where, "ops3.json")):
        d3 = strict_load(os.path.join(where, "ops3.json"))
        note = f"trace ops {sum(1 for e in d3['traceEvents'] if e.get('cat') == 'op')}, meta {d3['otherData']['distgrad']['ops'].get('worker0')}"
    say(ok3, f"a user's scheduled profiler (wait phase at the open): error {err}, the user's profile {got.get('names')}, {note}")
    say(not distgrad.trace.is_tracing(), "nothing left recording")
    return res


if __name__ == "__main__":
    where = tempfile.mkdtemp(prefix="audit-ops-"); os.chmod(where, 0o700)
    lines = run_workers(_run, world_size=2, timeout=120, args=(where, 1))[0]
    try:
        lines += run_workers(_run, world_size=2, timeout=120, args=(where, 3))[0]
    except Exception as e:  # noqa: BLE001 - the tracer died
        lines.append(f"FAIL a user's scheduled profiler (wait phase at the open) and profile_ops: "
                     f"{str(e).splitlines()[0][:150]}")
    print("\n".join(lines))
    print("summary:", "FAIL" if any(l.startswith("FAIL") for l in lines) else "PASS")
