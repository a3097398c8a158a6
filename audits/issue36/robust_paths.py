"""A trace must never cost the job: paths, odd span values, nesting, threads, bounds,
GC, the user's exception. Two real workers on 127.0.0.1; worker0 runs every stage,
each printed PASS/FAIL (the lines come back from worker0 and are printed here)."""
import os, sys, tempfile, threading
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import perfetto_problems, run_workers, strict_load


def _stages(rank, world_size, where):
    import gc, torch, distgrad, distgrad.rpc as rpc
    if rank != 0:
        return []
    res = []
    one = torch.ones(2)

    def say(ok, what):
        res.append(f"{'PASS' if ok else 'FAIL'} {what}")

    def valid(path, what):
        try:
            doc = strict_load(path)
            probs = perfetto_problems(doc)
            say(not probs, f"{what}: strict JSON, trace-event fields {'ok' if not probs else probs[:3]}")
            return doc
        except Exception as e:  # noqa: BLE001
            say(False, f"{what}: {type(e).__name__}: {e}")

    def cleanup():
        if distgrad.trace.is_tracing():
            try:
                distgrad.trace.stop()
            except Exception:  # noqa: BLE001
                pass

    # 1. a directory the file-writing rule (safe_files) refuses: group-writable
    d = tempfile.mkdtemp(dir=where); os.chmod(d, 0o775)
    p = os.path.join(d, "t.json")
    try:
        distgrad.trace.start(p)
        rpc.rpc_sync("worker1", torch.add, args=(one, 1))   # the user's block runs ...
        try:
            distgrad.trace.stop()
            say(os.path.exists(p), "group-writable dir: accepted at start and written")
        except Exception as e:  # noqa: BLE001
            say(False, f"group-writable dir: start() accepted it, the block ran, then stop() lost the "
                       f"trace: {type(e).__name__}: {str(e)[:160]}")
    except Exception as e:  # noqa: BLE001
        say(True, f"group-writable dir refused at start: {str(e)[:100]}")
    cleanup()

    # 2. a span with a meta / quantized / nested tensor (a user logging a shape-only tensor)
    for label, mk in (("meta", lambda: torch.empty(3, device="meta")),
                      ("quantized", lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)),
                      ("nested", lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]))):
        p = os.path.join(where, f"span-{label}.json")
        try:
            with distgrad.trace(p):
                with distgrad.trace.span("logged", t=mk()):
                    rpc.rpc_sync("worker1", torch.add, args=(one, 1))
            say(True, f"span arg {label} tensor: the block ends normally")
            valid(p, f"span arg {label} tensor file")
        except Exception as e:  # noqa: BLE001
            say(False, f"span arg {label} tensor: the span's exit raised into the user's code: "
                       f"{type(e).__name__}: {str(e)[:80]}")
        cleanup()
    # ... and inside a block that raised its own error
    try:
        with distgrad.trace(os.path.join(where, "span-meta-err.json")):
            with distgrad.trace.span("logged", t=torch.empty(3, device="meta")):
                raise KeyError("the user's own")
    except KeyError:
        say(True, "meta tensor span + user's KeyError: the KeyError propagates")
    except Exception as e:  # noqa: BLE001
        say(False, f"meta tensor span + user's KeyError: replaced by {type(e).__name__}: {str(e)[:60]}")
    cleanup()

    # 3. the user's exception inside the block, file still written
    p = os.path.join(where, "exc.json")
    try:
        with distgrad.trace(p):
            rpc.rpc_sync("worker1", torch.add, args=(one, 1))
            raise ZeroDivisionError("mine")
    except ZeroDivisionError:
        say(os.path.exists(p), "user's ZeroDivisionError propagates and the file is written")
        valid(p, "exc.json")
    cleanup()

    # 4. nested traces
    p1, p2 = os.path.join(where, "outer.json"), os.path.join(where, "inner.json")
    try:
        with distgrad.trace(p1):
            try:
                with distgrad.trace(p2):
                    pass
                say(False, "nested trace: accepted")
            except RuntimeError as e:
                say("already" in str(e), f"nested trace refused: {str(e)[:90]}")
            rpc.rpc_sync("worker1", torch.add, args=(one, 1))
        say(os.path.exists(p1) and not os.path.exists(p2), "outer trace written after the refused inner")
    except Exception as e:  # noqa: BLE001
        say(False, f"nested: {type(e).__name__}: {e}")
    cleanup()

    # 5. two threads open a trace at the same moment
    bar = threading.Barrier(2)
    outcome = {}

    def opener(i):
        bar.wait()
        try:
            with distgrad.trace(os.path.join(where, f"thread{i}.json")):
                for _ in range(20):
                    rpc.rpc_sync("worker1", torch.add, args=(one, 1))
            outcome[i] = "written"
        except Exception as e:  # noqa: BLE001
            outcome[i] = f"{type(e).__name__}: {str(e)[:100]}"
    ts = [threading.Thread(target=opener, args=(i,)) for i in range(2)]
    [t.start() for t in ts]; [t.join(60) for t in ts]
    written = [i for i, o in outcome.items() if o == "written"]
    say(len(written) == 1, f"two threads open at once: {outcome}")
    for i in written:
        valid(os.path.join(where, f"thread{i}.json"), f"thread{i}.json")
    cleanup()
    try:
        with distgrad.trace(os.path.join(where, "after-threads.json")):
            rpc.rpc_sync("worker1", torch.add, args=(one, 1))
        say(True, "a trace opens after the two threads")
    except Exception as e:  # noqa: BLE001
        say(False, f"a trace after the two threads: {type(e).__name__}: {str(e)[:120]}")
    cleanup()

    # 6. the member opens a trace while worker0's is open
    try:
        with distgrad.trace(os.path.join(where, "w0.json")):
            try:
                rpc.rpc_sync("worker1", _member_opens, args=(where,), timeout=30)
                say(False, "member opened a second trace while one is open")
            except Exception as e:  # noqa: BLE001
                say("already" in str(e), f"member's trace refused: {str(e).splitlines()[0][:110]}")
        say(rpc.rpc_sync("worker1", distgrad.trace.is_tracing) is False, "member not recording after the close")
    except Exception as e:  # noqa: BLE001
        say(False, f"member opens: {type(e).__name__}: {e}")
    cleanup()

    # 7. links and directories
    target = os.path.join(where, "precious.txt")
    with open(target, "w") as f:
        f.write("keep me")
    link = os.path.join(where, "link.json")
    os.symlink(target, link)
    with distgrad.trace(link):
        rpc.rpc_sync("worker1", torch.add, args=(one, 1))
    say(open(target).read() == "keep me" and not os.path.islink(link),
        "symlink path: the link replaced, its target untouched")
    valid(link, "link.json")
    dlink = os.path.join(where, "dirlink.json"); os.symlink(where, dlink)
    for label, pth in (("a directory", where), ("a link to a directory", dlink),
                       ("a missing directory", os.path.join(where, "nope", "t.json")),
                       ("an empty path", ""), ("a file as the directory", os.path.join(target, "t.json"))):
        try:
            distgrad.trace.start(pth)
            say(False, f"path {label}: accepted at start")
        except Exception as e:  # noqa: BLE001
            say(not distgrad.trace.is_tracing(), f"path {label}: refused at start ({type(e).__name__}: {str(e)[:70]})")
        cleanup()

    # 8. max_events tiny, huge, silly
    p = os.path.join(where, "max1.json")
    with distgrad.trace(p, max_events=1):
        for _ in range(30):
            rpc.rpc_sync("worker1", torch.add, args=(one, 1))
    doc = valid(p, "max_events=1")
    if doc:
        m = doc["otherData"]["distgrad"]
        say(all(v > 0 for v in m["dropped"].values()), f"max_events=1: dropped {m['dropped']}, recorded {m['recorded']}")
    for mx in (0, -5, 10**19, float("inf"), float("nan"), "many"):
        try:
            distgrad.trace.start(os.path.join(where, "mx.json"), max_events=mx)
            say(False, f"max_events={mx!r}: accepted")
        except Exception as e:  # noqa: BLE001
            st = rpc.rpc_sync("worker1", distgrad.trace.is_tracing)
            say(not distgrad.trace.is_tracing() and not st,
                f"max_events={mx!r}: refused ({type(e).__name__}: {str(e)[:60]}), nothing left recording (member {st})")
        cleanup()
    p = os.path.join(where, "maxhuge.json")
    try:
        with distgrad.trace(p, max_events=10**15):
            rpc.rpc_sync("worker1", torch.add, args=(one, 1))
        valid(p, "max_events=10**15")
    except Exception as e:  # noqa: BLE001
        say(False, f"max_events=10**15: {type(e).__name__}: {e}")
    cleanup()

    # 9. GC during a trace; a user thread's span; a relative path and a chdir in the block
    p = os.path.join(where, "gc.json")
    with distgrad.trace(p):
        junk = [[i] for i in range(200000)]
        for j in junk[:1000]:
            j.append(j)
        del junk
        gc.collect()
        t = threading.Thread(target=lambda: _span_in_thread(), name="user-thread")
        t.start(); t.join()
        rpc.rpc_sync("worker1", torch.add, args=(one, 1))
    doc = valid(p, "gc.json")
    if doc:
        ev = doc["traceEvents"]
        gcs = [e for e in ev if e.get("cat") == "gc"]
        say(bool(gcs) and all("pause_us" in e["args"] for e in gcs), f"gc pauses recorded as instants: {len(gcs)}")
        tn = [e for e in ev if e["ph"] == "M" and e["name"] == "thread_name" and e["args"]["name"] == "user-thread"]
        say(bool(tn), "a user thread's span on its own named track (thread already exited at the close)")
    old = os.getcwd()
    a = tempfile.mkdtemp(dir=where); b = tempfile.mkdtemp(dir=where)
    os.chdir(a)
    try:
        distgrad.trace.start("rel.json")
        os.chdir(b)
        out = distgrad.trace.stop()
        say(os.path.exists(os.path.join(a, "rel.json")),
            f"relative path, chdir in the block: written in the start's directory "
            f"(in a: {os.path.exists(os.path.join(a, 'rel.json'))}, in b: {os.path.exists(os.path.join(b, 'rel.json'))}, returned {out!r})")
    except Exception as e:  # noqa: BLE001
        say(False, f"relative path + chdir: {type(e).__name__}: {e}")
    finally:
        os.chdir(old)
    cleanup()
    return res


def _span_in_thread():
    import distgrad
    with distgrad.trace.span("in a user thread", k=1):
        sum(range(10000))


def _member_opens(where):
    import distgrad
    distgrad.trace.start(os.path.join(where, "member.json"))
    distgrad.trace.stop()


if __name__ == "__main__":
    where = tempfile.mkdtemp(prefix="audit-robust-")
    os.chmod(where, 0o700)
    lines = run_workers(_stages, world_size=2, timeout=150, args=(where,))[0]
    print("\n".join(lines))
    fails = [ln for ln in lines if ln.startswith("FAIL")]
    print("summary:", "PASS" if not fails else f"FAIL ({len(fails)})")
