"""Local multi-process launcher, a drop-in for ``torchrun --nproc-per-node N``.

Example::

    python -m distgrad.launch --nproc-per-node 2 train.py --epochs 3
"""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

_IS_WINDOWS = sys.platform == "win32"
_SIGKILL = getattr(signal, "SIGKILL", signal.SIGTERM)
_POLL_S = 0.05


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the launcher's arguments to ``parser`` (or a new parser) and return it.

    Reusable as a subcommand parser, e.g.::

        sub = argparse.ArgumentParser().add_subparsers()
        build_parser(sub.add_parser("launch"))
    """
    if parser is None:
        parser = argparse.ArgumentParser(
            prog="python -m distgrad.launch",
            description="Start N local worker processes with torchrun-style environment variables.",
        )
    parser.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=int,
                        default=1, help="number of worker processes to start (default: 1)")
    parser.add_argument("--master-addr", "--master_addr", dest="master_addr", default="127.0.0.1",
                        help="MASTER_ADDR given to workers (default: 127.0.0.1)")
    parser.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                        help="MASTER_PORT given to workers (default: a free port)")
    parser.add_argument("--grace-period", dest="grace_period", type=float, default=5.0,
                        help="seconds between SIGTERM and SIGKILL when stopping workers (default: 5)")
    parser.add_argument("-m", "--module", action="store_true",
                        help="treat the script as a Python module name, like 'python -m'")
    parser.add_argument("script", help="training script (or module with -m) to run in each worker")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def find_free_port(addr: str = "127.0.0.1") -> int:
    """Return a TCP port that is currently free on ``addr``.

    Example::

        port = find_free_port()  # e.g. 45123
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((addr, 0))
        except OSError:
            sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _forward(stream: IO[bytes], out: IO[str], prefix: bytes, lock: threading.Lock) -> None:
    """Copy ``stream`` to ``out`` line by line, prefixing each line."""
    buf = getattr(out, "buffer", None)
    try:
        for line in iter(stream.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            with lock:
                if buf is not None:
                    out.flush()
                    buf.write(prefix + line)
                    buf.flush()
                else:
                    out.write((prefix + line).decode("utf-8", "replace"))
                    out.flush()
    except (OSError, ValueError):
        pass
    finally:
        stream.close()


def _signal_all(procs: Sequence[subprocess.Popen], sig: int) -> None:
    """Send ``sig`` to each worker's whole process group (or the process on Windows)."""
    for p in procs:
        try:
            if _IS_WINDOWS:
                if p.poll() is None:
                    p.kill() if sig == _SIGKILL else p.terminate()
            else:
                os.killpg(p.pid, sig)  # children are session leaders: pgid == pid
        except (ProcessLookupError, PermissionError, OSError):
            pass


def _stop_all(procs: Sequence[subprocess.Popen], grace_period: float) -> None:
    """SIGTERM every worker group, SIGKILL after ``grace_period`` seconds, and reap them."""
    _signal_all(procs, signal.SIGTERM)
    deadline = time.monotonic() + grace_period
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(_POLL_S)
    _signal_all(procs, _SIGKILL)  # also reaches leftover grandchildren in the groups
    for p in procs:
        p.wait()


def launch(args: argparse.Namespace) -> int:
    """Run the workers described by parsed ``args``; return the launcher's exit code.

    Example::

        code = launch(build_parser().parse_args(["--nproc-per-node", "2", "train.py"]))
    """
    nproc = int(args.nproc_per_node)
    if nproc < 1:
        print("distgrad.launch: --nproc-per-node must be >= 1", file=sys.stderr)
        return 2
    port = args.master_port if args.master_port is not None else find_free_port(args.master_addr)
    base_env = dict(os.environ)
    # No agent hosts a store here (rank 0 does): drop torchrun's flag, if inherited.
    base_env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    base_env.setdefault("DISTGRAD_SECRET", secrets.token_hex(32))
    if nproc > 1:
        base_env.setdefault("OMP_NUM_THREADS", "1")  # same default torchrun applies
    base_env.update(MASTER_ADDR=str(args.master_addr), MASTER_PORT=str(port),
                    WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0",
                    ROLE_RANK="0", ROLE_WORLD_SIZE=str(nproc), PYTHONUNBUFFERED="1")
    cmd = [sys.executable] + (["-m"] if args.module else []) + [args.script] + list(args.script_args)

    stop_signal: list[int] = []

    def _on_signal(signum: int, _frame: object) -> None:
        stop_signal.append(signum)

    handled = [signal.SIGINT, signal.SIGTERM]
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for s in handled:
            previous[s] = signal.signal(s, _on_signal)

    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    lock = threading.Lock()
    popen_kw: dict = ({"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP}  # type: ignore[attr-defined]
                      if _IS_WINDOWS else {"start_new_session": True})
    try:
        for rank in range(nproc):
            env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
            p = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, **popen_kw)
            procs.append(p)
            prefix = f"[rank{rank}]: ".encode()
            for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                t = threading.Thread(target=_forward, args=(stream, out, prefix, lock), daemon=True)
                t.start()
                threads.append(t)
            if stop_signal:
                break

        exit_code = 0
        while not stop_signal:
            failed = [(r, p) for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                rank, p = failed[0]
                rc = p.returncode
                exit_code = rc if rc > 0 else 128 + (-rc)
                how = f"exit code {rc}" if rc > 0 else f"signal {-rc} (exit code {exit_code})"
                print(f"distgrad.launch: worker rank {rank} (pid {p.pid}) failed with {how}; "
                      f"terminating the other workers", file=sys.stderr, flush=True)
                _stop_all(procs, args.grace_period)
                break
            if all(p.poll() == 0 for p in procs):
                break
            time.sleep(_POLL_S)
        if stop_signal:
            signum = stop_signal[0]
            print(f"distgrad.launch: received signal {signum}; terminating workers",
                  file=sys.stderr, flush=True)
            _stop_all(procs, args.grace_period)
            exit_code = 130 if signum == signal.SIGINT else 128 + int(signum)
        return exit_code
    except BaseException:
        _stop_all(procs, args.grace_period)
        raise
    finally:
        for t in threads:
            t.join(timeout=2.0)
        for s, h in previous.items():
            signal.signal(s, h)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), launch the workers, return the exit code.

    Example::

        sys.exit(main(["--nproc-per-node", "2", "train.py", "--lr", "0.1"]))
    """
    args = build_parser().parse_args(None if argv is None else list(argv))
    return launch(args)
