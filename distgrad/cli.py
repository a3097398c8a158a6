"""The ``distgrad`` command.

Examples::

    distgrad demo                                  # train the demo on a 4-process local cluster
    distgrad demo --workers 5 --steps 300 --out /tmp/demo
    distgrad launch --nproc-per-node 2 train.py    # torchrun --nproc-per-node 2 --tee 3, one node
    distgrad launch --nnodes 1:4 --nproc-per-node 2 --max-restarts 3 \\
        --rdzv-endpoint 10.0.0.1:29400 --rdzv-id job1 train.py   # elastic, as torchrun
    distgrad store --port 29500                    # a store that outlives a dynamic group's members
    distgrad trace-plot trace.json -o step.png     # draw a distgrad.trace file, print its summary
    python -m distgrad demo                        # same as `distgrad demo`
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser(*, top_level_only: bool = False) -> argparse.ArgumentParser:
    """The ``distgrad`` command's parser. ``top_level_only`` leaves out the options of
    ``launch`` (torchrun's parser) and ``demo``, which import torch: enough to print
    ``distgrad --help``, which lists only the commands.

    Example::

        >>> build_parser(top_level_only=True).prog
        'distgrad'
    """
    parser = argparse.ArgumentParser(
        prog="distgrad",
        description="distgrad: distributed autograd for PyTorch and the RPC framework under it.")
    parser.add_argument("--version", action=_Version, nargs=0, default=argparse.SUPPRESS,
                        help="show the version and which message path runs (compiled or not)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    demo = sub.add_parser(
        "demo", help="train a model-parallel digits classifier on a local cluster",
        description="Start a local cluster (driver, parameter server, model stages) and train a "
                    "model-parallel classifier on scikit-learn's digits with distributed autograd "
                    "and DistributedOptimizer; writes training curves and the autograd graph.")
    if not top_level_only:
        from .demo import add_arguments
        add_arguments(demo)
    if top_level_only:
        launch_parents: dict = {}
    else:
        from .launch.launcher import build_parser as build_launch_parser
        launch_parents = {"parents": [build_launch_parser()], "add_help": False}
    sub.add_parser(
        "launch", **launch_parents,
        help="torchrun (torch.distributed.run) plus a generated DISTGRAD_SECRET",
        description="torchrun with torchrun's options (--nnodes 1:4, --max-restarts, "
                    "--rdzv-backend/--rdzv-endpoint/--rdzv-id, --log-dir, --redirects, --tee, "
                    "--local-ranks-filter, -m, ...). distgrad adds: DISTGRAD_SECRET generated when "
                    "unset on a one-node job; --tee 3 with lines prefixed '[rank<R>]: ' unless "
                    "--tee/--redirects is given; --rdzv-backend distgrad unless another is named "
                    "(torch's dynamic rendezvous with its state as sealed JSON: nothing read from "
                    "a store is unpickled; on one node it stays in the agent, and the workers' "
                    "store listens on MASTER_ADDR 127.0.0.1 or --master-addr alone). Exit code: "
                    "the first failed worker's.")
    bn = sub.add_parser(
        "build-native", help="build the native distributed autograd engine now (else on first use)",
        description="Compile distgrad's native share of a distributed backward (one GraphTask of "
                    "torch's engine per worker per pass) against the installed torch, into "
                    "$DISTGRAD_NATIVE_CACHE or ~/.cache/distgrad/native; needs a C++ compiler and "
                    "ninja. Without them the Python engine runs every pass (the reason is "
                    "printed; exit code 0 unless --require).")
    bn.add_argument("--require", action="store_true",
                    help="exit with code 1 when the native engine cannot be built")
    store = sub.add_parser(
        "store", help="serve a torch.distributed TCPStore for dynamic groups (until interrupted)",
        description="Serve the rendezvous store of a dynamic group (init_rpc without world_size) "
                    "in a process of its own, so that every member, rank 0 included, may leave, "
                    "crash and be replaced. Members then set DISTGRAD_STORE_HOSTED=1 and "
                    "init_method tcp://HOST:PORT.")
    store.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: 127.0.0.1, this host only; give the "
                            "address the members reach, or 0.0.0.0, to serve other hosts)")
    store.add_argument("--port", type=int, default=29500, help="port (default: 29500)")
    tp = sub.add_parser(
        "trace-plot", help="draw a distgrad.trace file (workers as rows) and print its summary",
        description="Draw a trace written by distgrad.trace(path) with matplotlib: one row per "
                    "worker, its time coloured computing / serving / network / idle, messages as "
                    "arrows, the critical path underlined; print each worker's shares and the "
                    "critical path of the step.")
    tp.add_argument("trace", help="the trace file (JSON) distgrad.trace wrote")
    tp.add_argument("-o", "--output", default="trace.png", help="the picture to write (default: trace.png)")
    tp.add_argument("--title", default=None, help="the picture's title (default: the trace's path)")
    return parser


def _serve_store(host: str, port: int) -> int:
    import time

    from .rpc.membership import serve_store
    try:
        store = serve_store(host, port)
    except Exception as e:  # noqa: BLE001 - a port in use: say so
        print(f"distgrad store: cannot serve on {host}:{port}: {e}", file=sys.stderr)
        return 1
    print(f"distgrad store: serving on {host}:{port} (DISTGRAD_STORE_HOSTED=1 on the members)",
          flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        del store


class _Version(argparse.Action):
    """``--version``: printed as it is (argparse's own action would wrap the line), and
    only when asked (it imports distgrad to say which message path runs)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog} {_version()}")
        parser.exit()


def _version() -> str:
    from . import info
    i = info()
    why = f": the install fell back: {i['install_fell_back']}" if "install_fell_back" in i else ""
    engine = f"{i['autograd_engine']} autograd engine"
    if "autograd_engine_why" in i:
        engine += f": {i['autograd_engine_why']}"
    return f"{i['version']} ({i['message_path']} message path{why}; {engine})"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``distgrad`` command; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # `distgrad --help` prints only the commands: it need not import torch (distgrad/__init__
    # skips the layers for it too), which takes seconds
    args = build_parser(top_level_only=bool(argv) and argv[0] in ("-h", "--help")).parse_args(argv)
    if args.command == "demo":
        from .demo import run
        return run(args)
    if args.command == "launch":
        from .launch.launcher import launch
        return launch(args)
    if args.command == "store":
        return _serve_store(args.host, args.port)
    if args.command == "build-native":
        from .autograd import native
        mod = native.load()
        if mod is None:
            print(f"distgrad: the native autograd engine cannot be built: {native.WHY_NOT}; "
                  "the Python engine runs every pass", file=sys.stderr)
            return 1 if args.require else 0
        print(f"distgrad: native autograd engine built: {mod.__file__}")
        return 0
    if args.command == "trace-plot":
        from .trace.plot import main as trace_plot
        return trace_plot(args)
    raise AssertionError(args.command)  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
