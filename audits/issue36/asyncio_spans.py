"""A user who writes asyncio code: coroutines on ONE thread each run
`with distgrad.trace.span(...)` around an await (rpc_async's future awaited through
asyncio.wrap_future). Their spans overlap partially on one thread track. Checks:
the written file's X events on each (pid, tid) nest (Perfetto's JSON importer
cannot draw partial overlaps on one track: it drops or misnests them; torch.profiler
puts async work on separate async tracks), and trace-plot's summary stays linear on a
stream of 1,500 and 4,500 such calls, 8 in flight.
Run: cd <repo> && PYTHONPATH=$PWD DISTGRAD_PURE=1 python audits/issue36/asyncio_spans.py"""
import os, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run_workers, strict_load, perfetto_problems


def _slow(x, s):
    time.sleep(s)
    return x + 1


def _run(rank, world_size, where, n=40, limit=None, slow=True):
    import asyncio, torch, distgrad, distgrad.rpc as rpc
    if rank != 0:
        rpc.api._barrier(["worker0", "worker1"])
        return None

    async def job(i, sem):
        async with sem:
            with distgrad.trace.span(f"coroutine {i}"):
                fut = rpc.rpc_async("worker1", _slow, args=(torch.ones(1), 0.01 * (i % 5 + 1) if slow else 0))
                await asyncio.wrap_future(_to_cf(fut))

    def _to_cf(fut):
        import concurrent.futures
        cf = concurrent.futures.Future()
        fut.add_done_callback(lambda f: cf.set_result(None))
        return cf

    async def main():
        sem = asyncio.Semaphore(limit or n)
        await asyncio.gather(*(job(i, sem) for i in range(n)))
    p = os.path.join(where, f"a{n}.json")
    with distgrad.trace(p):
        asyncio.run(main())
    rpc.api._barrier(["worker0", "worker1"])
    return p


def overlaps(doc):
    by = {}
    for e in doc["traceEvents"]:
        if e.get("ph") == "X":
            by.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    bad = []
    for k, xs in by.items():
        xs.sort(key=lambda x: (x[0], -x[1]))
        stack = []
        for a, b, n in xs:
            while stack and stack[-1][1] <= a:
                stack.pop()
            if stack and b > stack[-1][1] + 1e-3:
                bad.append((k, stack[-1][2], n))
            stack.append((a, b, n))
    return bad


if __name__ == "__main__":
    where = tempfile.mkdtemp(prefix="audit-async-"); os.chmod(where, 0o700)
    p = run_workers(_run, world_size=2, timeout=120, args=(where,))[0]
    doc = strict_load(p)
    probs = perfetto_problems(doc)
    bad = overlaps(doc)
    print(f"{'PASS' if not probs else 'FAIL'} trace-event fields: {probs[:3]}")
    print(f"{'PASS' if not bad else 'FAIL'} X events nest on each thread track: {len(bad)} partial overlaps, e.g. {bad[:2]}")
    from distgrad.trace.summary import summarize
    t0 = time.perf_counter(); summarize(doc); print(f"INFO summary {time.perf_counter() - t0:.2f} s")
    # a stream of coroutines, 8 in flight: the trace-plot summary at 1,500 and 4,500 calls
    times = {}
    for n in (1500, 4500):
        p = run_workers(_run, world_size=2, timeout=300, args=(where, n, 8, False))[0]
        d = strict_load(p)
        t0 = time.perf_counter(); summarize(d); times[n] = time.perf_counter() - t0
        print(f"INFO asyncio stream of {n} calls (8 in flight): summary {times[n]:.2f} s "
              f"({1e6 * times[n] / n:.0f} us per call)", flush=True)
    lin = times[4500] / max(times[1500], 1e-3)
    print(f"{'PASS' if lin < 4.5 else 'FAIL'} 3x the calls: {lin:.1f}x the summary time (linear ~3x)")
    print("summary:", "FAIL" if probs or bad or lin >= 4.5 else "PASS")
