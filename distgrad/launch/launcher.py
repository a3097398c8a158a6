"""``distgrad launch``: torchrun (``torch.distributed.run``) plus a cluster secret.

Every option is torchrun's own, parsed by torchrun's parser and run by its
elastic agent (``torch.distributed.run.run``): ``--nnodes 1:4``,
``--max-restarts``, ``--rdzv-backend c10d``, ``--rdzv-endpoint``,
``--rdzv-id``, ``--monitor-interval``, ``--shutdown-timeout``, ``--log-dir``,
``--redirects``, ``--tee``, ``--local-ranks-filter``, ``-m``/``--module``, ...
The agent starts, watches, restarts and stops the workers; what this module
adds before handing over:

- ``DISTGRAD_SECRET``: when unset and the job has one node (``--nnodes`` at
  most 1), a fresh ``secrets.token_hex(32)`` for all workers; with more nodes
  every node must export the same one, so it warns instead.
- Rank-prefixed output: ``--tee 3`` unless ``--tee`` or ``--redirects`` is
  given, with the line prefix ``[rank<global rank>]: `` (e.g. ``[rank0]: loss
  0.25``) unless ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` is set (torchrun's
  own prefix is ``[default0]:``, role and local rank).
- The rendezvous: ``--rdzv-backend distgrad`` unless another is named
  (:mod:`.elastic_rdzv`: torch's dynamic rendezvous, its state kept as sealed
  JSON; nothing read from a store is unpickled). One node and no endpoint
  (the default, and ``--standalone``): the state stays in the agent, and the
  workers' store listens on ``--master-addr`` (127.0.0.1) alone, so workers get
  MASTER_ADDR=127.0.0.1 and a free MASTER_PORT. Elastic or several nodes:
  ``--rdzv-endpoint HOST:PORT`` and ``--rdzv-id``. A fixed node count with
  ``--master-port`` (or several nodes without an endpoint) is torchrun's
  static rendezvous. ``--rdzv-backend c10d`` (or etcd) runs with a warning:
  torch's agent unpickles its state from its store.
- Arguments that cannot work are refused with a message (exit code 2); a
  failed worker makes the launch exit with that worker's exit code (128 +
  signal for a signal; torchrun exits 1), a signal to the launcher with
  128 + signal after the agent stopped the workers.

Example::

    python -m distgrad.launch --nproc-per-node 2 train.py --epochs 3
    # elastic, 1 to 4 nodes, restart the group up to 3 times (same line on every node):
    DISTGRAD_SECRET=... distgrad launch --nnodes 1:4 --nproc-per-node 2 --max-restarts 3 \\
        --rdzv-endpoint 10.0.0.1:29400 --rdzv-id job1 train.py
"""
from __future__ import annotations

import argparse
import os
import secrets
import sys
import uuid
from collections.abc import Sequence

from ..errors import DistgradError
from ..transport.handshake import GOOD_SECRET_HINT, secret_bits
from .elastic_rdzv import NAME, register

_PREFIX_TEMPLATE = "[rank${rank}]: "
_DEVICE_COUNTS = ("auto", "cpu", "gpu", "xpu")


class LaunchError(ValueError):
    """A launcher argument or combination of them that cannot work (exit code 2)."""


def build_parser(prog: str = "python -m distgrad.launch") -> argparse.ArgumentParser:
    """torchrun's argument parser with distgrad's defaults (also a ``parents=`` entry).

    Example::

        args = build_parser().parse_args(["--nproc-per-node", "2", "train.py"])
        sub = argparse.ArgumentParser().add_subparsers()
        sub.add_parser("launch", parents=[build_parser()], add_help=False)
    """
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = prog
    parser.description = ("torchrun (torch.distributed.run) with a generated DISTGRAD_SECRET, "
                          "rank-prefixed output (--tee 3) and a rendezvous that unpickles nothing "
                          "(--rdzv-backend distgrad, the default).")
    # None = "not given" (torchrun's env action reads PET_<NAME> the same way)
    parser.set_defaults(tee=os.environ.get("PET_TEE"),
                        master_addr=os.environ.get("PET_MASTER_ADDR"),
                        rdzv_backend=os.environ.get("PET_RDZV_BACKEND"))
    return parser


def _node_range(nnodes: str) -> tuple[int, int]:
    lo, sep, hi = str(nnodes).partition(":")
    try:
        n_min, n_max = int(lo), int(hi if sep else lo)
    except ValueError:
        raise LaunchError(f"--nnodes must be N or MIN:MAX, got {nnodes!r}") from None
    if not 1 <= n_min <= n_max:
        raise LaunchError(f"--nnodes {nnodes}: need 1 <= MIN <= MAX")
    return n_min, n_max


def _check(args: argparse.Namespace) -> int:
    """Refuse what cannot work (LaunchError); fill distgrad's defaults; return max nodes."""
    n_min, n_max = _node_range(args.nnodes)
    nproc = str(args.nproc_per_node)
    if nproc not in _DEVICE_COUNTS and not (nproc.isdigit() and int(nproc) >= 1):
        raise LaunchError(f"--nproc-per-node must be a number >= 1 or one of "
                          f"{', '.join(_DEVICE_COUNTS)}, got {nproc!r}")
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise LaunchError(f"--master-port must be in 1..65535, got {args.master_port}")
    if args.standalone:   # torchrun's --standalone: one node on localhost, a fresh run id
        if n_max != 1:
            raise LaunchError(f"--standalone is one node; --nnodes {args.nnodes} asks for more")
        args.standalone = False
        args.rdzv_backend, args.rdzv_endpoint = NAME, ""
        args.rdzv_id = str(uuid.uuid4())
    backend = args.rdzv_backend
    if backend is None:   # not given: distgrad's rendezvous unless a static one is asked for
        # (a fixed count of several nodes, with an endpoint or not, or a port: torchrun's
        # static rendezvous, node ranks and all)
        backend = "static" if n_min == n_max and (n_max > 1 or args.master_port is not None) \
            else NAME
        args.rdzv_backend = backend
    static = backend == "static"
    if static and n_min != n_max:
        raise LaunchError(f"--nnodes {args.nnodes} is an elastic range: give --rdzv-endpoint "
                          "HOST:PORT (the static rendezvous needs a fixed count)")
    if static and not 0 <= args.node_rank < n_max:
        raise LaunchError(f"--node-rank {args.node_rank} is out of range for --nnodes "
                          f"{args.nnodes} (0 <= node rank < nnodes)")
    if static and args.node_rank > 0 and args.master_addr is None and not args.rdzv_endpoint:
        raise LaunchError(f"--node-rank {args.node_rank} of --nnodes {args.nnodes} needs "
                          "--master-addr: the address of node 0, whose agent hosts the store")
    named_addr = args.master_addr is not None
    master_addr = args.master_addr or "127.0.0.1"
    if master_addr.startswith("[") and master_addr.endswith("]"):
        master_addr = master_addr[1:-1]   # an IPv6 address as torchrun writes it
    if args.local_addr is not None and len(args.local_addr) > 1024:
        raise LaunchError(f"--local-addr has {len(args.local_addr)} characters: a host name or "
                          "address is at most 1024")
    if backend == NAME:
        if n_max > 1 and not args.rdzv_endpoint:
            raise LaunchError(f"--nnodes {args.nnodes}: several nodes meet at --rdzv-endpoint "
                              "HOST:PORT (the agent on HOST hosts the rendezvous store)")
        if args.rdzv_id == "none":
            if n_max > 1:
                raise LaunchError(f"--nnodes {args.nnodes}: give --rdzv-id JOB, the same on "
                                  "every node (it names this job's rendezvous)")
            args.rdzv_id = str(uuid.uuid4())
        if n_max == 1 and args.local_addr is None:
            args.local_addr = master_addr   # the workers' store: 127.0.0.1 by default
    elif backend != "static":
        print(f"distgrad launch: warning: --rdzv-backend {backend}: torch's agent keeps its "
              "rendezvous state in its store as a pickle and unpickles what it reads there: "
              "anyone who can write to that store (whoever reaches its port) runs code as this "
              f"user. Use --rdzv-backend {NAME} (the default), which keeps it as sealed JSON",
              file=sys.stderr, flush=True)
    args.master_addr = master_addr
    # the static rendezvous's store, hosted by node 0: bound here on the address
    # named (torch's would listen on every interface), then shared by torch's
    # multi_tenant TCPStore on the same port in this process. Node 0 of several
    # without --master-addr or an endpoint keeps torch's wildcard: others must reach
    # it somehow. One node without a port gets a free one: torchrun would otherwise
    # turn the launch into its c10d rendezvous (a pickle from a store bound everywhere).
    args.distgrad_host_store = None
    if static and args.node_rank == 0:
        if args.rdzv_endpoint:
            host, _, port = args.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit():
                raise LaunchError(f"--rdzv-endpoint {args.rdzv_endpoint} of the static "
                                  "rendezvous needs HOST:PORT")
            args.distgrad_host_store = (host.strip("[]"), int(port))
        elif n_max == 1 or named_addr:
            args.distgrad_host_store = (master_addr, args.master_port or 0)
    if args.tee is None:
        args.tee = "0" if args.redirects != "0" else "3"
    return n_max


def launch(args: argparse.Namespace) -> int:
    """Run torchrun's elastic agent on parsed ``args``; return the exit code.

    Example::

        code = launch(build_parser().parse_args(["--nproc-per-node", "2", "train.py"]))
    """
    try:
        max_nodes = _check(args)
    except LaunchError as e:
        print(f"distgrad launch: {e}", file=sys.stderr)
        return 2
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import run

    register()   # --rdzv-backend distgrad (the default)

    added = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": _PREFIX_TEMPLATE}
    if max_nodes == 1:
        added["DISTGRAD_SECRET"] = secrets.token_hex(32)
    elif not os.environ.get("DISTGRAD_SECRET"):
        print("distgrad launch: warning: no DISTGRAD_SECRET: with several nodes the launcher "
              "cannot make one up for all of them; export the same secret on every node (else "
              f"messages are not authenticated). Make one with: {GOOD_SECRET_HINT}",
              file=sys.stderr, flush=True)
    elif secret_bits(os.fsencode(os.environ["DISTGRAD_SECRET"])) < 128:
        print("distgrad launch: warning: DISTGRAD_SECRET looks weaker than 128 bits: anyone who "
              f"reaches a worker can try guesses at it. Make a good one with: {GOOD_SECRET_HINT}",
              file=sys.stderr, flush=True)
    added = {k: v for k, v in added.items() if k not in os.environ}
    os.environ.update(added)  # the agent's environment is the workers'
    held = None
    try:
        if getattr(args, "distgrad_host_store", None):
            held = _host_static_store(args)
        if args.rdzv_backend == "static" and max_nodes == 1 and not args.rdzv_endpoint \
                and args.master_port is None:   # torchrun would make it its c10d rendezvous
            raise DistgradError("a one-node static rendezvous without a port (refused: torchrun "
                                "would turn it into its pickle-based c10d rendezvous)")
        record(run)(args)
        return 0
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr, flush=True)
        code = e.get_first_failure()[1].exitcode  # the root cause; < 0: killed by a signal
        return code if code > 0 else 128 - code if code < 0 else 1
    except RendezvousError as e:
        print(f"distgrad launch: the rendezvous failed ({type(e).__name__}): {e}",
              file=sys.stderr, flush=True)
        return 1
    except (DistgradError, ValueError) as e:   # a store that cannot be hosted, a bad option
        print(f"distgrad launch: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    except SignalException as e:
        print(f"distgrad launch: received {e.sigval.name}; the workers were stopped",
              file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    finally:
        del held
        for key in added:
            os.environ.pop(key, None)


def _host_static_store(args: argparse.Namespace):
    """Host the static rendezvous's store where ``_check`` said (torch's agent then
    opens its multi_tenant store on the same port and shares this server); a port 0
    becomes the free one taken, as ``--master-port``."""
    from datetime import timedelta

    from .listen import host_store

    host, port = args.distgrad_host_store
    store = host_store(host, port, None, timedelta(seconds=300), multi_tenant=True)
    if port == 0:
        args.master_port = store.port
    return store


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) as torchrun does, launch, return the exit code.

    Example::

        sys.exit(main(["--nproc-per-node", "2", "train.py", "--lr", "0.1"]))
    """
    return launch(build_parser().parse_args(None if argv is None else list(argv)))
