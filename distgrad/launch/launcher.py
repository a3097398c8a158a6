"""Multi-process launcher, a drop-in for torchrun's static launch
(``torchrun --nnodes N --node-rank R --nproc-per-node P``).

One launcher runs on each node and starts that node's workers with torchrun's
variables: RANK = node_rank * nproc_per_node + local_rank, WORLD_SIZE =
nnodes * nproc_per_node, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the node
rank), GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME, MASTER_ADDR,
MASTER_PORT. As torchrun's, a launcher supervises only its own node's workers:
a worker on another node that dies is seen by the workers here (closed
connection or missed heartbeats: ``WorkerLostError``), not by this launcher.

Example::

    python -m distgrad.launch --nproc-per-node 2 train.py --epochs 3
    # two nodes, on each (R = 0 on the first, 1 on the second):
    distgrad launch --nnodes 2 --node-rank R --nproc-per-node 2 \\
        --master-addr 10.0.0.1 --master-port 29500 train.py
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
_DEFAULT_MASTER_ADDR = "127.0.0.1"
_DEFAULT_MULTI_NODE_PORT = 29500  # torchrun's default MASTER_PORT


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the launcher's arguments to ``parser`` (or a new parser) and return it.

    Reusable as a subcommand parser, e.g.::

        sub = argparse.ArgumentParser().add_subparsers()
        build_parser(sub.add_parser("launch"))
    """
    if parser is None:
        parser = argparse.ArgumentParser(
            prog="python -m distgrad.launch",
            description="Start this node's worker processes with torchrun-style environment "
                        "variables.",
        )
    parser.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=int,
                        default=1, help="number of worker processes to start on this node (default: 1)")
    parser.add_argument("--nnodes", dest="nnodes", default="1",
                        help="number of nodes, N or N:N (fixed; elastic ranges are not supported; "
                             "default: 1)")
    parser.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
                        help="rank of this node, 0 <= R < nnodes (default: 0)")
    parser.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None,
                        help="MASTER_ADDR given to workers: the address of node 0, where rank 0 "
                             "hosts the store (default: 127.0.0.1; required on node ranks > 0)")
    parser.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                        help="MASTER_PORT given to workers (default: a free port on one node, "
                             f"{_DEFAULT_MULTI_NODE_PORT} with --nnodes > 1, as torchrun)")
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


class LaunchError(ValueError):
    """A launcher argument or combination of them that cannot work (exit code 2)."""


def parse_nnodes(value: str) -> int:
    """The fixed node count of ``--nnodes`` (``"N"`` or ``"N:N"``, as torchrun writes it).

    Example::

        parse_nnodes("2")    # 2
        parse_nnodes("2:2")  # 2; "1:4" raises LaunchError (elastic)
    """
    lo, sep, hi = str(value).partition(":")
    try:
        n_min, n_max = int(lo), int(hi if sep else lo)
    except ValueError:
        raise LaunchError(f"--nnodes must be N or N:N, got {value!r}") from None
    if n_min != n_max:
        raise LaunchError(f"--nnodes {value}: elastic node ranges are not supported (torchrun's "
                          "static launch only); give a fixed number of nodes")
    if n_min < 1:
        raise LaunchError(f"--nnodes must be >= 1, got {value!r}")
    return n_min


def worker_env(nnodes: int, node_rank: int, nproc: int, local_rank: int) -> dict[str, str]:
    """The rank variables torchrun's agent gives one worker (static rendezvous, one
    worker group per node, the default role).

    Example::

        worker_env(2, 1, 2, 0)["RANK"]  # '2': node 1's first worker
    """
    world = nnodes * nproc
    rank = node_rank * nproc + local_rank
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(node_rank),
            "GROUP_WORLD_SIZE": str(nnodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
            "ROLE_NAME": "default"}


def _check_args(args: argparse.Namespace) -> tuple[int, int, int, str, int | None]:
    """``(nnodes, node_rank, nproc, master_addr, master_port)`` or LaunchError."""
    nproc = int(args.nproc_per_node)
    if nproc < 1:
        raise LaunchError(f"--nproc-per-node must be >= 1, got {nproc}")
    nnodes = parse_nnodes(getattr(args, "nnodes", "1"))
    node_rank = int(getattr(args, "node_rank", 0))
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank {node_rank} is out of range for --nnodes {nnodes} "
                          f"(0 <= node rank < nnodes)")
    addr = args.master_addr
    if nnodes > 1 and node_rank > 0 and addr is None:
        raise LaunchError(f"--node-rank {node_rank} of --nnodes {nnodes} needs --master-addr: "
                          "the address of node 0, where rank 0 hosts the store")
    port = args.master_port
    if port is not None and not 0 < port < 65536:
        raise LaunchError(f"--master-port must be in 1..65535, got {port}")
    if port is None and nnodes > 1:
        port = _DEFAULT_MULTI_NODE_PORT  # every node must agree: a free port here would not
    return nnodes, node_rank, nproc, addr or _DEFAULT_MASTER_ADDR, port


def _multi_node_warnings(nnodes: int, master_addr: str) -> list[str]:
    out = []
    if master_addr.startswith("127.") or master_addr in ("localhost", "::1"):
        out.append(f"--nnodes {nnodes} with the loopback --master-addr {master_addr}: workers on "
                   "other hosts cannot reach it (fine only when every node runs on this host)")
    if not os.environ.get("DISTGRAD_SECRET"):
        out.append("no DISTGRAD_SECRET: with several nodes the launcher cannot make one up for "
                   "all of them; export the same secret on every node (else messages are not "
                   "authenticated)")
    return out


def launch(args: argparse.Namespace) -> int:
    """Run this node's workers described by parsed ``args``; return the launcher's exit code.

    Example::

        code = launch(build_parser().parse_args(["--nproc-per-node", "2", "train.py"]))
    """
    try:
        nnodes, node_rank, nproc, master_addr, port = _check_args(args)
    except LaunchError as e:
        print(f"distgrad.launch: {e}", file=sys.stderr)
        return 2
    if nnodes > 1:
        for warning in _multi_node_warnings(nnodes, master_addr):
            print(f"distgrad.launch: warning: {warning}", file=sys.stderr, flush=True)
    if port is None:
        port = find_free_port(master_addr)
    base_env = dict(os.environ)
    # No agent hosts a store here (rank 0 does): drop torchrun's flag, if inherited.
    base_env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if nnodes == 1:  # on several nodes every launcher must pass the same one: the user's
        base_env.setdefault("DISTGRAD_SECRET", secrets.token_hex(32))
    if nproc > 1:
        base_env.setdefault("OMP_NUM_THREADS", "1")  # same default torchrun applies
    base_env.update(MASTER_ADDR=master_addr, MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
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
        for local_rank in range(nproc):
            env = dict(base_env, **worker_env(nnodes, node_rank, nproc, local_rank))
            rank = node_rank * nproc + local_rank
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
                local_rank, p = failed[0]
                rank = node_rank * nproc + local_rank
                rc = p.returncode
                exit_code = rc if rc > 0 else 128 + (-rc)
                how = f"exit code {rc}" if rc > 0 else f"signal {-rc} (exit code {exit_code})"
                where = f"local rank {local_rank} on node {node_rank}, " if nnodes > 1 else ""
                print(f"distgrad.launch: worker rank {rank} ({where}pid {p.pid}) failed with {how}; "
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
