"""Run a function on N real worker processes (spawn) that talk over 127.0.0.1.

    results = run_workers(my_fn, world_size=3, timeout=60)

``my_fn(rank, world_size, *args)`` must be a module-level function; it runs
after ``init_rpc("worker{rank}")`` (unless ``init=False``) and before
``shutdown()``. Its return value (picklable) comes back per rank. An exception
on any rank, a crash or the timeout fails the test with every rank's story;
every process is killed before this returns.
"""
from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# How much slower than an idle machine a test may run before a time bound it asserts
# fails: a loaded 2-core machine runs about 3x slower (issue 34: a 50 s bound failed at
# 51.6 s at load average 7-9). A bound that only guards against a hang is multiplied
# by it; a bound that checks something ("at the loss, not at the 60 s call timeout")
# is multiplied by it together with the timeout it is measured against, so that it
# keeps its meaning. Set DISTGRAD_TEST_SLOWDOWN higher on a slower machine.
SLOW = float(os.environ.get("DISTGRAD_TEST_SLOWDOWN", "3"))


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections and to ``bind(port 0)``."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_HANDED: set[int] = set()   # ports this process already handed out


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and that the kernel will not hand to
    someone else before the caller binds it.

    A port from ``bind(port 0)`` lies in the ephemeral range, where every outgoing
    connection of every process (a worker's dial, a store client) may take it between
    this probe and the caller's bind: CI failed on that once (EADDRINUSE on a store's
    port). So the port is drawn at random below the ephemeral range, which only an
    explicit bind takes, and is never handed out twice by one process.
    """
    high = min(_ephemeral_low(), 32768)   # exclusive: the ephemeral range starts there
    low = 20000 if high > 20100 else 1024
    rng = random.SystemRandom()
    for _ in range(200 if high > low else 0):   # no room below it: the kernel's choice
        port = rng.randrange(low, high)
        if port in _HANDED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED.add(port)
        return port
    with socket.socket() as s:   # a crowded machine: fall back to the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_STACKS: list = []   # the file faulthandler writes a worker's stacks to (kept open)


def _bootstrap(rank, world_size, fn, args, init, port, options, results, shutdown_graceful, env,
               stacks=None):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if stacks and hasattr(signal, "SIGUSR1"):   # every thread's stack on SIGUSR1 (a hang)
        _STACKS.append(open(stacks, "w"))
        faulthandler.register(signal.SIGUSR1, file=_STACKS[0], all_threads=True)
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    import torch
    torch.set_num_threads(1)
    try:
        if init:
            import distgrad.rpc as rpc
            opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                                   **(options or {}))
            rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
        value = fn(rank, world_size, *args)
        if init:
            rpc.shutdown(graceful=shutdown_graceful)
        results.put((rank, "ok", value))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_workers(fn: Callable, world_size: int = 2, timeout: float = 60, args: tuple = (),
                init: bool = True, options: dict | None = None, graceful: bool = True,
                expect_exit: set | None = None, env_per_rank: dict | None = None) -> list[Any]:
    """Run ``fn`` on ``world_size`` spawned workers; returns the per-rank results.

    Every worker gets the cluster secret ``DISTGRAD_SECRET=distgrad-tests``
    (so the suite runs authenticated, as users should); ``env_per_rank``
    ({rank: {VAR: value or None to unset}}) overrides per worker.

    Ranks in ``expect_exit`` may die without reporting (tests that kill workers);
    their result is None.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    # Rank 0's store runs in a process of its own by default (distgrad/launch/keeper.py):
    # about 1 s more for each group's start, some 200 of them in the suite. Test modules
    # about the store (USES_STORE_PROCESS = True at module level) and a run with
    # DISTGRAD_TEST_STORE_PROCESS=1 keep the default; the rest host it in rank 0.
    keeper = os.environ.get("DISTGRAD_TEST_STORE_PROCESS") == "1" or \
        sys._getframe(1).f_globals.get("USES_STORE_PROCESS", False)
    stack_dir = tempfile.mkdtemp(prefix="distgrad-stacks-")
    procs = [ctx.Process(target=_bootstrap, daemon=True,
                         args=(r, world_size, fn, args, init, port, options, results, graceful,
                               {"DISTGRAD_SECRET": "distgrad-tests",
                                "DISTGRAD_STORE_PROCESS": "1" if keeper else "0",
                                **(env_per_rank or {}).get(r, {})},
                               os.path.join(stack_dir, f"worker{r}.txt")))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    failed: set[int] = set()  # ranks whose error already arrived (they exit next)
    expect_exit = expect_exit or set()
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in range(world_size) if r not in out]
                raise TimeoutError(f"workers {missing} did not finish within {timeout} s; "
                                   f"errors so far: {errors}"
                                   + _stacks_of(procs, missing, stack_dir))
            try:
                rank, status, value = results.get(timeout=min(left, 0.2))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if not p.is_alive() and r not in out and r not in failed
                        and r not in expect_exit]
                if dead:
                    # a worker that exited cleanly queued its result before it left:
                    # give it time to arrive, even on a loaded machine
                    clean = all(procs[r].exitcode == 0 for r in dead)
                    try:
                        rank, status, value = results.get(timeout=15.0 if clean else 2.0 * SLOW)
                    except queue.Empty:
                        raise RuntimeError(f"worker(s) {dead} died with exit codes "
                                           f"{[procs[r].exitcode for r in dead]}") from None
                else:
                    gone = [r for r in expect_exit if not procs[r].is_alive() and r not in out]
                    for r in gone:
                        out[r] = None
                    continue
            if status == "ok":
                out[rank] = value
            else:
                failed.add(rank)
                errors.append(f"--- worker{rank} ---\n{value}")
        if errors:
            raise AssertionError("\n".join(errors))
        return [out[r] for r in range(world_size)]
    finally:
        reap(procs, max(0.1, min(5.0, deadline - time.monotonic() + 5)))
        shutil.rmtree(stack_dir, ignore_errors=True)


def reap(procs: list, grace: float = 20.0) -> None:
    """Join ``procs`` (``grace`` seconds each); kill those still alive."""
    for p in procs:
        p.join(timeout=grace)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def _stacks_of(procs, ranks, stack_dir: str) -> str:
    """Every thread's stack of the workers ``ranks`` that are still alive (a hang)."""
    alive = [r for r in ranks if procs[r].is_alive() and procs[r].pid]
    for r in alive:
        with contextlib.suppress(OSError):
            os.kill(procs[r].pid, signal.SIGUSR1)
    if not alive:
        return ""
    time.sleep(1.0)
    parts = []
    for r in alive:
        try:
            with open(os.path.join(stack_dir, f"worker{r}.txt")) as f:
                parts.append(f"\n--- worker{r}'s threads ---\n{f.read()[-12000:]}")
        except OSError:
            pass
    return "".join(parts)


@contextlib.contextmanager
def distgrad_store(port: int) -> Iterator[subprocess.Popen]:
    """``distgrad store`` serving on 127.0.0.1:``port`` in a process of its own,
    for the block (the store of a dynamic group whose members all come and go)."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    server = subprocess.Popen([sys.executable, "-m", "distgrad", "store", "--host", "127.0.0.1",
                               "--port", str(port)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        assert "serving on 127.0.0.1" in line, line
        yield server
    finally:
        server.terminate()
        server.wait(10)


def tmp_path_for(name: str) -> str:
    return os.path.join(tempfile.mkdtemp(prefix="distgrad-"), name)


def run_differential(script: str, impl: str, timeout: float = 400) -> tuple[dict, str]:
    """Run ``tests/<script> --impl <impl>`` (a differential program that prints one
    JSON record as its last line); returns the record and its stderr (on a hang the
    program prints every thread's stack there)."""
    import json
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, os.path.join(here, script), "--impl", impl],
                       capture_output=True, text=True, timeout=timeout, cwd=here)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def differential_equal(script: str) -> None:
    """Assert that ``script`` records the same observations on torch and on distgrad.
    torch's run is the reference and gets a second chance if it hung (a rendezvous
    that never met, seen once in a full suite run); distgrad's gets none."""
    want, _ = run_differential(script, "torch")
    if "hung" in want:
        print(f"torch's reference run: {want['error']}; run again")
        want, _ = run_differential(script, "torch")
    got, err = run_differential(script, "distgrad")
    assert "error" not in want, want
    assert got == want, err[-12000:]
