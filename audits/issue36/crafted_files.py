"""trace-plot on crafted and truncated files: each must end in one line saying what is
wrong (rc 1, no traceback) or a picture (rc 0), within seconds. Runs plot.main in
process (what the CLI runs) on each file."""
import contextlib, io, json, os, sys, tempfile, time, types
from distgrad.trace.plot import main

d = tempfile.mkdtemp(prefix="audit-crafted-")
os.chmod(d, 0o700)
good = {"traceEvents": [
    {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "w0"}},
    {"ph": "X", "name": "rpc_sync f → w1", "cat": "rpc.call", "pid": 1, "tid": 5, "ts": 0, "dur": 10, "args": {}},
], "otherData": {"distgrad": {"tracer": "w0", "window_us": [0, 20]}}}
def ev(**kw):
    e = {"ph": "X", "name": "x", "cat": "rpc.serve", "pid": 1, "tid": 5, "ts": 0, "dur": 1, "args": {}}
    e.update(kw); return e
def doc(events=None, meta=None, **top):
    d_ = {"traceEvents": [good["traceEvents"][0]] + (events or []), "otherData": {"distgrad": meta if meta is not None else {"tracer": "w0"}}}
    d_.update(top); return d_
cases = {
    "empty file": "",
    "truncated": json.dumps(good)[:57],
    "not json": "hello",
    "a list": "[]",
    "null": "null",
    "traceEvents dict": json.dumps({"traceEvents": {}}),
    "event a number": json.dumps({"traceEvents": [1]}),
    "no events": json.dumps({"traceEvents": []}),
    "process_name no pid": json.dumps({"traceEvents": [{"ph": "M", "name": "process_name", "args": {"name": "w"}}]}),
    "pid a list": json.dumps(doc([ev(pid=[1])])),
    "tid a list": json.dumps(doc([ev(tid=[1])])),
    "tid a dict": json.dumps(doc([ev(tid={})])),
    "process_name pid list": json.dumps({"traceEvents": [{"ph": "M", "name": "process_name", "pid": [1], "tid": 0, "args": {"name": "w"}}]}),
    "name a number": json.dumps(doc([ev(name=5)])),
    "name null on send": json.dumps(doc([ev(name=None, cat="rpc.send")])),
    "args a list": json.dumps(doc([ev(args=[1])])),
    "ts string": json.dumps(doc([ev(ts="0")])),
    "dur negative": json.dumps(doc([ev(dur=-5)])),
    "ts NaN": json.dumps(doc([ev(ts=float("nan"))])),
    "ts huge": json.dumps(doc([ev(ts=1e308, dur=1e308)])),
    "distgrad a list": json.dumps(doc([ev()], meta=[])),
    "otherData a list": json.dumps({"traceEvents": [ev()], "otherData": []}),
    "tracer a list": json.dumps(doc([ev()], meta={"tracer": ["w0"]})),
    "tracer unknown": json.dumps(doc([ev()], meta={"tracer": "nobody"})),
    "missing a list": json.dumps(doc([ev()], meta={"tracer": "w0", "missing": ["x"]})),
    "missing values dict": json.dumps(doc([ev()], meta={"tracer": "w0", "missing": {"w9": {"a": 1}}})),
    "workers a list": json.dumps(doc([ev()], meta={"tracer": "w0", "workers": ["w0"]})),
    "window reversed": json.dumps(doc([ev()], meta={"tracer": "w0", "window_us": [5, 1]})),
    "window strings": json.dumps(doc([ev()], meta={"tracer": "w0", "window_us": ["a", "b"]})),
    "flow id list": json.dumps(doc([{"ph": "s", "id": [1], "pid": 1, "tid": 5, "ts": 0}, {"ph": "f", "id": [1], "pid": 1, "tid": 5, "ts": 1}])),
    "flow ts string": json.dumps(doc([{"ph": "s", "id": 1, "pid": 1, "tid": 5, "ts": "x"}, {"ph": "f", "id": 1, "pid": 1, "tid": 5, "ts": 1}])),
    "flow to unknown pid": json.dumps(doc([ev(), {"ph": "s", "id": 1, "pid": 9, "tid": 5, "ts": 0}, {"ph": "f", "id": 1, "pid": 1, "tid": 5, "ts": 0.5}])),
    "serve rid from unknown": json.dumps(doc([ev(args={"rid": 3, "from": "ghost"})], meta={"tracer": "w0", "workers": {"ghost": {"rank": 2**60}}})),
    "gc args list": json.dumps(doc([ev(), {"ph": "i", "cat": "gc", "pid": 1, "tid": 5, "ts": 0, "args": []}])),
    "gc pause string": json.dumps(doc([ev(), {"ph": "i", "cat": "gc", "pid": 1, "tid": 5, "ts": 0, "args": {"pause_us": "x"}}])),
    "sort_index string": json.dumps({"traceEvents": [{"ph": "M", "name": "process_sort_index", "pid": 1, "args": {"sort_index": "a"}}, good["traceEvents"][0]]}),
    "deep nesting": "[" * 100000 + "]" * 100000,
    "utf8 garbage": b"\xff\xfe\x00garbage",
    "a picture": b"\x89PNG\r\n\x1a\n" + os.urandom(200),
}
bad = 0
for name, content in cases.items():
    p = os.path.join(d, "c.json")
    with open(p, "wb") as f:
        f.write(content if isinstance(content, bytes) else content.encode())
    buf = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(buf):
            rc = main(types.SimpleNamespace(trace=p, output=os.path.join(d, "c.png"), title=None))
        out = buf.getvalue().strip()
        dt = time.perf_counter() - t0
        lines = out.splitlines()
        ok = (rc == 1 and len(lines) == 1 and "cannot read" in out) or (rc == 0 and "wrote" in out)
        ok = ok and dt < 10
        shown = lines[0] if rc == 1 else f"drawn ({len(lines)} lines)"
        print(f"{'PASS' if ok else 'FAIL'} {name}: rc {rc}, {dt:.1f} s: {shown[:150]}")
    except BaseException as e:
        ok = False
        print(f"FAIL {name}: escaped {type(e).__name__}: {str(e)[:120]}")
    bad += not ok
print("summary:", "PASS" if not bad else f"FAIL ({bad})")
