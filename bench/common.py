"""Shared benchmark harness for distgrad vs torch.distributed.rpc.

Reusable pieces:
  * ``run_cluster(impl, world_size, worker_fn, timeout)`` -- spawn a fresh
    local RPC cluster (multiprocessing *spawn* context, free TCP port on
    127.0.0.1), run ``worker_fn(rpc_module)`` on rank 0 and return its result
    dict.  Every wait is bounded; workers are always terminated/killed.
  * ``print_table(metrics, results, impls)`` -- one row per metric, one column
    per implementation plus a distgrad/torch ratio column.
  * ``proc_cpu_seconds(pid)`` -- user+system CPU seconds of a process (all
    threads), from psutil if installed, else /proc/<pid>/stat.

``worker_fn`` must be picklable by reference (a module-level function in an
importable module).  The bench dir and repo root are put on ``sys.path`` here
(and in PYTHONPATH), and spawn children inherit the parent's sys.path, so
``import rpc_bench`` / ``import common`` work inside workers.
"""
from __future__ import annotations

import importlib
import json
import math
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import sys
import time
import traceback

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
for _p in (BENCH_DIR, REPO_ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)
_pp = os.environ.get("PYTHONPATH", "")
for _p in (BENCH_DIR, REPO_ROOT):
    if _p not in _pp.split(os.pathsep):
        _pp = _p + (os.pathsep + _pp if _pp else "")
os.environ["PYTHONPATH"] = _pp
# distgrad runs authenticated, as deployed (torch ignores the variable): the
# figures include the cost of the per-message MAC.
os.environ.setdefault("DISTGRAD_SECRET", "bench-" + os.urandom(8).hex())

IMPL_MODULES = {
    "torch": "torch.distributed.rpc",
    "distgrad": "distgrad.rpc",
}


def impl_module_name(impl: str) -> str:
    return IMPL_MODULES.get(impl, impl)


def interleaved(first, second, warm: int, reps: int) -> tuple[list, list]:
    """``warm`` untimed runs of both, then ``reps`` of each, which one goes first
    alternating (drift hits both alike); returns their results, in order."""
    for _ in range(warm):
        first()
        second()
    a, b = [], []
    for i in range(reps):
        if i % 2:
            a.append(first())
            b.append(second())
        else:
            b.append(second())
            a.append(first())
    return a, b


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------
# process CPU accounting
# --------------------------------------------------------------------------
def proc_cpu_seconds(pid: int) -> float:
    """utime+stime (seconds, all threads) of process ``pid``."""
    try:
        import psutil  # type: ignore

        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    except ImportError:
        pass
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read().decode()
    # comm (field 2) may contain spaces/parens: split after the last ')'
    fields = data[data.rindex(")") + 2:].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14, 15 overall
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> float:
    """User + system CPU seconds of this process, all its threads (an RPC target):
    ``getrusage`` (microseconds) where there is one; ``os.times`` counts in clock
    ticks (10 ms), too coarse for a mesh of short rounds."""
    try:
        import resource
        u = resource.getrusage(resource.RUSAGE_SELF)
        return u.ru_utime + u.ru_stime
    except ImportError:   # Windows
        t = os.times()
        return t.user + t.system


def cluster_cpu_seconds(rpc, names) -> float:
    """This process's CPU seconds plus those of the workers ``names`` (asked over RPC):
    read before and after a measured window, the difference is what the whole cluster
    spent in it, busy polling included."""
    return cpu_seconds() + sum(rpc.rpc_sync(n, cpu_seconds) for n in names)


def pids_with_env(entry: str) -> list:
    """Pids of this user's processes whose environment holds ``entry``
    ("NAME=value"); Linux /proc only, else []."""
    needle = entry.encode() + b"\0"
    pids = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return pids
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = b"\0" + f.read()
        except OSError:
            continue
        if b"\0" + needle in env + b"\0":
            pids.append(int(name))
    return pids


def can_read_proc_cpu() -> bool:
    try:
        proc_cpu_seconds(os.getpid())
        return True
    except Exception:
        return False


# --------------------------------------------------------------------------
# cluster runner
# --------------------------------------------------------------------------
def worker_name(rank: int) -> str:
    return f"worker{rank}"


# (time.time() at init_rpc start, at init_rpc end) of this worker; read by
# workloads through ``rpc_sync(w, common.init_times)``.
INIT_TIMES: list = []


def init_times():
    """RPC target: this worker's wall-clock init_rpc (start, end)."""
    return tuple(INIT_TIMES)


def _die_with_parent():
    """Linux: SIGKILL this worker when the process that spawned it dies, so a
    killed benchmark driver (timeout, Ctrl-C, OOM) leaves no workers behind."""
    try:
        import ctypes
        import signal
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        parent = mp.parent_process()
        if parent is not None and os.getppid() != parent.pid:
            os._exit(1)  # parent already gone before prctl
    except Exception:
        pass


def _worker_entry(impl, rank, world_size, port, worker_fn, result_q,
                  rpc_timeout, num_worker_threads, prepare=None):
    """Body of every spawned worker process (module-level => picklable)."""
    _die_with_parent()
    if prepare is not None:
        prepare()
    rpc = None
    initialized = False
    import warnings
    warnings.filterwarnings("ignore", message="You are using a Backend")
    warnings.filterwarnings("ignore", message="`TorchScript` support for functional")
    try:
        rpc = importlib.import_module(impl_module_name(impl))
        opts = rpc.TensorPipeRpcBackendOptions(
            init_method=f"tcp://127.0.0.1:{port}",
            rpc_timeout=rpc_timeout,
            num_worker_threads=num_worker_threads,
        )
        t0, w0 = time.perf_counter(), time.time()
        rpc.init_rpc(worker_name(rank), rank=rank, world_size=world_size,
                     rpc_backend_options=opts)
        init_s = time.perf_counter() - t0
        INIT_TIMES[:] = [w0, time.time()]
        initialized = True
        if rank == 0:
            result = worker_fn(rpc)
            if result is None:
                result = {}
            result = dict(result)
            result.setdefault("init_rpc_s", init_s)
            result_q.put(("result", rank, result))
        t0 = time.perf_counter()
        rpc.shutdown()  # graceful: waits for all workers
        initialized = False
        result_q.put(("shutdown", rank, time.perf_counter() - t0))
    except BaseException:
        result_q.put(("error", rank, traceback.format_exc()))
        if initialized and rpc is not None:
            try:
                rpc.shutdown(graceful=False)
            except BaseException:
                pass
    finally:
        # Don't let queue feeder thread block exit forever.
        try:
            result_q.close()
            result_q.join_thread()
        except BaseException:
            pass


def _spawn(ctx, procs, env, **kw):
    """Start one process with ``env`` (name -> value, None = unset) applied to
    os.environ only while it starts: spawn children copy the parent's env."""
    saved = {k: os.environ.get(k) for k in (env or {})}
    try:
        for k, v in (env or {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(v)
        p = ctx.Process(daemon=True, **kw)
        p.start()
        procs.append(p)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _reap(procs, grace=5.0):
    """Terminate, then kill, every process still alive; one shared deadline
    (a 32-worker cluster must not take 32 x grace)."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    end = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))


def run_cluster(impl, world_size, worker_fn, timeout=300.0, *,
                rpc_timeout=120.0, num_worker_threads=16,
                shutdown_grace=20.0, env=None, prepare=None):
    """Spawn a fresh ``world_size`` cluster of ``impl`` on 127.0.0.1.

    Rank 0 runs ``worker_fn(rpc_module)`` after ``init_rpc`` and its returned
    dict is handed back here through a multiprocessing Queue; other ranks just
    ``init_rpc`` + ``shutdown``.  Returns the dict (plus ``init_rpc_s`` and
    ``shutdown_s``).  Raises RuntimeError with the worker traceback(s) on
    failure, TimeoutError if rank 0 produces nothing within ``timeout`` s.
    Workers are always terminated (then killed) before returning.
    ``env``: extra environment variables for the workers only. ``prepare``: a
    picklable callable every worker runs first, before ``init_rpc`` (for instance
    ``torch.set_num_threads``).
    """
    ctx = mp.get_context("spawn")
    result_q = ctx.Queue()
    port = free_port()
    procs = []
    deadline = time.monotonic() + timeout
    result = None
    errors = {}
    shutdown_times = {}
    try:
        for rank in range(world_size):
            _spawn(ctx, procs, env, target=_worker_entry,
                   args=(impl, rank, world_size, port, worker_fn, result_q,
                         rpc_timeout, num_worker_threads, prepare),
                   name=f"{impl}-{worker_name(rank)}")

        # Wait for rank 0's result (or any error), bounded by `timeout`.
        while result is None and not errors:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{impl}: no result from rank 0 within {timeout:.0f}s")
            try:
                kind, rank, payload = result_q.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [p for p in procs
                        if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    # give a just-written error message a moment to arrive
                    try:
                        kind, rank, payload = result_q.get(timeout=2.0)
                    except queue_mod.Empty:
                        raise RuntimeError(
                            f"{impl}: worker(s) died: " + ", ".join(
                                f"{p.name} exitcode={p.exitcode}" for p in dead)) from None
                else:
                    continue
            if kind == "result":
                result = payload
            elif kind == "error":
                errors[rank] = payload
            elif kind == "shutdown":
                shutdown_times[rank] = payload

        if errors:
            # collect a few more errors briefly (other ranks usually follow)
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                try:
                    kind, rank, payload = result_q.get(timeout=0.2)
                except queue_mod.Empty:
                    continue
                if kind == "error":
                    errors[rank] = payload
            msg = "\n".join(f"--- {impl} rank {r} ---\n{tb}"
                            for r, tb in sorted(errors.items()))
            raise RuntimeError(f"{impl}: worker error(s):\n{msg}")

        # Graceful shutdown, bounded.
        end = time.monotonic() + shutdown_grace
        while len(shutdown_times) < world_size and time.monotonic() < end:
            try:
                kind, rank, payload = result_q.get(timeout=0.2)
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs):
                    break
                continue
            if kind == "shutdown":
                shutdown_times[rank] = payload
            elif kind == "error":
                errors[rank] = payload
        for p in procs:
            p.join(timeout=max(0.1, end - time.monotonic()))
        result["shutdown_s"] = shutdown_times.get(0, float("nan"))
        if len(shutdown_times) < world_size or errors:
            result["shutdown_warning"] = (
                f"clean shutdown on ranks {sorted(shutdown_times)} of "
                f"{world_size}; errors: {errors or None}")
        return result
    finally:
        _reap(procs)
        try:
            result_q.close()
            result_q.cancel_join_thread()
        except Exception:
            pass


# --------------------------------------------------------------------------
# table printer
# --------------------------------------------------------------------------
class Metric:
    """A row of the comparison table.

    key:    key in the per-impl result dict
    label:  human readable name
    unit:   printed next to the label
    better: 'lower' or 'higher' (direction of the ratio column)
    fmt:    format spec for values
    """

    def __init__(self, key, label, unit, better="lower", fmt=".1f"):
        assert better in ("lower", "higher")
        self.key, self.label, self.unit = key, label, unit
        self.better, self.fmt = better, fmt


def _fmt(v, fmt):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    try:
        return format(v, fmt)
    except (TypeError, ValueError):
        return str(v)


def print_table(metrics, results, impls=("torch", "distgrad"),
                baseline="torch", candidate="distgrad", file=None):
    """Print one row per metric.

    results: {impl: {metric_key: value}} (missing impl/key -> '-').
    Ratio column = candidate/baseline, annotated with the direction that is
    better for that metric (e.g. latency: lower better; bandwidth: higher).
    """
    file = file or sys.stdout
    hdr = ["metric"] + list(impls) + [f"ratio {candidate}/{baseline}",
                                       "ratio meaning"]
    rows = []
    for m in metrics:
        row = [f"{m.label} [{m.unit}]"]
        for impl in impls:
            row.append(_fmt((results.get(impl) or {}).get(m.key), m.fmt))
        b = (results.get(baseline) or {}).get(m.key)
        c = (results.get(candidate) or {}).get(m.key)
        if isinstance(b, (int, float)) and isinstance(c, (int, float)) and b:
            row.append(f"{c / b:.2f}x")
        else:
            row.append("-")
        row.append(f"{m.better} better")
        rows.append(row)
    widths = [max(len(str(r[i])) for r in rows + [hdr]) for i in range(len(hdr))]

    def line(r):
        return "  ".join(
            (str(c).ljust(w) if i in (0, len(hdr) - 1) else str(c).rjust(w))
            for i, (c, w) in enumerate(zip(r, widths)))

    print(line(hdr), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for r in rows:
        print(line(r), file=file)


def dump_json(path, payload):
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str, sort_keys=True)
