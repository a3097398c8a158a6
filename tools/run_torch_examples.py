"""Run PyTorch's own RPC example programs on torch and on distgrad, side by side.

The programs are those of pytorch/examples' ``distributed/rpc`` folder (rnn,
rl, batch/reinforce, batch/parameter_server, parameter_server, pipeline,
ddp_rpc; parameter_server once more as "parameter_server x3", with its default
three trainers). This file holds none of their code: point it at a copy of that
folder. For each program it makes two variants in a temporary folder:

* **torch**: the program as it is, CUDA calls removed (``.cuda(...)``,
  ``"cuda:N"`` -> ``"cpu"``, ``device_ids=[...]``), its fixed ports 29500/29501
  moved to free ones, and the few per-program edits listed in ``PROGRAMS``
  (an added loss print where the program prints none, a smaller run where the
  original takes far more than a few minutes on 2 cores, synthetic MNIST-shaped
  data where the program downloads MNIST);
* **distgrad**: the same, with the imports swapped
  (``torch.distributed.rpc`` -> ``distgrad.rpc``, ``torch.distributed.autograd``
  -> ``distgrad.autograd``, ``torch.distributed.optim.DistributedOptimizer`` ->
  ``distgrad.optim``, ``torch.distributed.nn.RemoteModule`` -> ``distgrad.nn``).

Both run under the same ``sitecustomize`` (on PYTHONPATH, so in every process,
spawned children included): ``torch``/``random``/``numpy`` seeded with
``--seed`` at start-up, and a work-around for a torchvision whose C++ ops do
not load (a CUDA torchvision wheel on a CPU torch). Programs written for the
old gym API (``env.seed``, 4-tuple ``step``) get a small ``gym`` module over
gymnasium. Each run has a timeout (its whole process group is killed past it);
its printed numbers (losses, rewards, accuracy) are pulled out with the
program's patterns and compared: ``same?`` says ``yes`` when the values that
must match are identical (all of them, or the first N where torch's own runs
part later) and those only expected within torch's own float noise are within
their tolerance; ``close`` when within 1e-4 relative; ``no`` otherwise; ``n/a``
with the means for programs that are nondeterministic by design. The notes
under the table say, per program, what was edited and why runs may differ.
The per-program edits are written for the programs as on pytorch/examples'
main branch (rl on gymnasium, batch/parameter_server with its gloo process
group, pipeline with ResNetShard1/2); one that matches nothing stops the run
with an error naming it.

Usage (torch 2.x, CPU; gymnasium and torchvision installed)::

    python tools/run_torch_examples.py --examples-dir /path/to/examples/distributed/rpc
    python tools/run_torch_examples.py --examples-dir DIR --only rnn,rl --impl distgrad
    python tools/run_torch_examples.py --examples-dir DIR --distgrad-path /other/checkout \\
        --out /tmp/ex-logs --keep

``--out DIR`` keeps every run's log (``DIR/<program>.<impl>.log``) and the
table (``DIR/results.md``); ``--keep`` also keeps the generated variants.
Exit status 0 when every run that was asked for completed.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------
# the generic edits

IMPORT_SWAPS = [  # applied to the distgrad variant only
    (r"\btorch\.distributed\.rpc\b", "distgrad.rpc"),
    (r"\btorch\.distributed\.autograd\b", "distgrad.autograd"),
    (r"\bfrom torch\.distributed\.optim import DistributedOptimizer\b",
     "from distgrad.optim import DistributedOptimizer"),
    (r"\bfrom torch\.distributed\.nn import RemoteModule\b", "from distgrad.nn import RemoteModule"),
    (r"\btorch\.distributed\.optim\.DistributedOptimizer\b", "distgrad.optim.DistributedOptimizer"),
    (r"\btorch\.distributed\.nn\.RemoteModule\b", "distgrad.nn.RemoteModule"),
]

CUDA_EDITS = [  # applied to both variants
    (r"\.cuda\((?:[\w.]*)\)", ""),            # x.cuda(), x.cuda(rank), x.cuda(self.device)
    (r"""(["'])cuda:\d+\1""", '"cpu"'),        # "cuda:0" -> "cpu"
    (r",\s*device_ids=\[[^\]]*\]", ""),       # DDP(..., device_ids=[rank])
]

SITECUSTOMIZE = '''\
"""Start-up of every process of a run_torch_examples.py run (seed; torchvision work-around)."""
import os as _os

if _os.environ.get("RTE_TORCHVISION_FIX") == "1":
    import glob as _glob
    import importlib.util as _ilu
    _spec = _ilu.find_spec("torchvision")
    if _spec is not None and _spec.origin:
        import torch as _torch
        _libs = _glob.glob(_os.path.join(_os.path.dirname(_spec.origin), "_C*.so"))
        try:
            _torch.ops.load_library(_libs[0])
        except (OSError, IndexError):
            # a torchvision built for another torch (e.g. CUDA wheel on CPU torch):
            # declare the two ops it registers fake kernels for without a guard
            _lib = _torch.library.Library("torchvision", "DEF")
            _lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

if _os.environ.get("RTE_SEED"):
    import random as _random
    import torch as _torch
    _seed = int(_os.environ["RTE_SEED"])
    _random.seed(_seed)
    _torch.manual_seed(_seed)
    try:
        import numpy as _np
        _np.random.seed(_seed)
    except ImportError:
        pass
'''

OLD_GYM = '''\
"""gym's pre-0.26 API (env.seed, reset() -> obs, 4-tuple step) over gymnasium."""
import gymnasium as _gym


class _OldApiEnv:
    def __init__(self, env):
        self._env = env
        self._seed = None

    def seed(self, seed=None):
        self._seed = seed
        return [seed]

    def reset(self):
        if self._seed is not None:
            obs, _ = self._env.reset(seed=self._seed)
            self._seed = None
        else:
            obs, _ = self._env.reset()
        return obs

    def step(self, action):
        obs, reward, terminated, truncated, info = self._env.step(action)
        return obs, reward, terminated or truncated, info

    def __getattr__(self, name):
        return getattr(self._env, name)


def make(env_id, **kwargs):
    return _OldApiEnv(_gym.make(env_id, **kwargs))
'''

# --------------------------------------------------------------------------
# the programs


@dataclasses.dataclass
class Program:
    """One example program: where it is, how it is started and read."""
    name: str
    folder: str                       # relative to --examples-dir
    script: str
    metrics: list                     # [(label, regex with one group)], compared
    info: list = dataclasses.field(default_factory=list)  # [(label, regex)], shown, not compared
    edits: list = dataclasses.field(default_factory=list)  # [(file, regex, repl, why)]
    argv: list = dataclasses.field(default_factory=list)
    per_rank: int = 0                 # >0: start that many processes, "--rank=r" each
    old_gym: bool = False
    timeout: float = 600.0
    default: bool = True              # False: runs only when named in --only
    compare: str = "exact"            # "exact" | "count" (how many lines) | "none": nondeterministic
    exact_prefix: int = 0             # with "exact": only the first N values of each metric must match
    note: str = ""


NUM = r"(-?\d+(?:\.\d+)?(?:e[-+]?\d+)?|nan|inf)"


# parameter_server downloads MNIST: both of its rows read MNIST-shaped synthetic data instead
_FAKE_MNIST = [
    ("rpc_parameter_server.py", r"datasets\.MNIST\('\.\./data', train=True, download=True,",
     "datasets.FakeData(size=1280, image_size=(1, 28, 28), num_classes=10, random_offset=0,",
     "MNIST (a download) -> FakeData, 1280 train images"),
    ("rpc_parameter_server.py", r"datasets\.MNIST\('\.\./data', train=False,",
     "datasets.FakeData(size=320, image_size=(1, 28, 28), num_classes=10, random_offset=100000,",
     "MNIST test set -> FakeData, 320 images"),
]

PROGRAMS = [
    Program(
        "rnn", "rnn", "main.py",
        metrics=[("loss", r"^Training epoch \d+ loss " + NUM)],
        edits=[("main.py", r'print\("Training epoch \{\}"\.format\(epoch\)\)',
                'print("Training epoch {} loss {:.6f}".format(epoch, loss.item()))',
                "probe: prints the last loss of each epoch"),
               ("main.py", r"torch\.LongTensor\((batch, \w+)\) %", r"torch.randint(0, 1 << 30, (\1)) %",
                "data: seeded random ints instead of uninitialized torch.LongTensor memory"),
               ("rnn.py", r"^(\s*)(self\.emb_table_rref = rpc\.remote\(.*\)\n)",
                r"\1\2\1self.emb_table_rref.to_here()\n",
                "waits for the first remote constructor before the second")],
        timeout=300,
        note="as written it is nondeterministic even on torch alone: its data is uninitialized "
             "memory (torch.LongTensor(n, m)) and its two rpc.remote constructors run at once on the "
             "ps and race for its RNG; both made deterministic (seeded data, constructors in turn)"),
    Program(
        "rl", "rl", "main.py",
        metrics=[("last reward", r"Last reward: " + NUM), ("average reward", r"Average reward: " + NUM),
                 ("solved at", r"Solved! Running reward is now " + NUM)],
        edits=[("main.py", r"for i_episode in count\(1\):", "for i_episode in range(1, 101):",
                "at most 100 episodes (until solved: > 3 min on 2 cores)")],
        timeout=600,
        argv=["--log-interval=1"], exact_prefix=80,
        note="world_size 2 (its default): one observer, all steps in sequence; yet torch alone is not "
             "reproducible past episode ~88 (torch runs with the same seed part at episode 89 or 93, "
             "e.g. last reward 127 vs 76): each step's policy forward runs on whichever RPC thread "
             "serves it, autograd's sequence numbers are per thread, so the order in which the "
             "episode's backward sums the shared weights' gradients (last bits) varies from run to "
             "run until a sampled action flips. The first 80 episodes must match"),
    Program(
        "batch/reinforce", "batch", "reinforce.py",
        metrics=[("last reward", r"Last reward: " + NUM), ("average reward", r"Average reward: " + NUM)],
        info=[("time batch/no-batch", r"^(\d+, [\d.]+, [\d.]+)$")],
        old_gym=True, exact_prefix=30,
        edits=[("reinforce.py", r"for world_size in range\(2, 12\):", "for world_size in range(2, 4):",
                "world sizes 2..3 instead of 2..11"),
               ("reinforce.py", r"self\.policy\(self\.states\.cuda\(\)\)", "self.policy(self.states.clone())",
                "keeps the copy .cuda() made: the states buffer is written in place at the next step")],
        timeout=900,
        note="runs world size 2 batch, 2 no-batch, 3 batch, 3 no-batch (10 episodes each); the last "
             "is nondeterministic by design: the agent samples for the observers in the order their "
             "requests arrive; the first 30 episodes must match"),
    Program(
        "batch/parameter_server", "batch", "parameter_server.py",
        metrics=[("PS updates", r"(PS updated model)")],
        timeout=600, compare="count",
        note="5 trainers race for the PS; gradients summed in arrival order; prints no loss: "
             "compares the number of PS updates"),
    Program(
        "parameter_server", "parameter_server", "rpc_parameter_server.py",
        metrics=[("loss", r"training batch \d+ loss " + NUM), ("accuracy", r"^Accuracy " + NUM)],
        argv=["--world_size=2"], per_rank=2,
        edits=_FAKE_MNIST,
        timeout=600,
        note="--world_size=2: the PS and one trainer (with more trainers their steps interleave)"),
    Program(
        "parameter_server x3", "parameter_server", "rpc_parameter_server.py",
        metrics=[("loss", r"training batch \d+ loss " + NUM), ("accuracy", r"Accuracy " + NUM)],
        argv=["--world_size=4"], per_rank=4, compare="none", default=False, timeout=240,
        edits=_FAKE_MNIST,
        note="(only with --only) its default --world_size=4: three trainers step the shared model "
             "while the others' backward passes still need its saved weights, so on torch and distgrad "
             "alike trainers usually die with 'modified by an inplace operation' (the launcher of each "
             "rank still exits 0: see the tracebacks count); torch's PS then waits forever in "
             "shutdown (timeout), distgrad's shutdown leaves the lost trainers out"),
    Program(
        "pipeline", "pipeline", "main.py",
        metrics=[("loss, batches 0-1", r"^loss b[01] " + NUM), ("loss, batch 2", r"^loss b2 " + NUM, 1e-2)],
        info=[("time per split", r"number of splits = (\d+, execution time = [\d.]+)")],
        edits=[("main.py", r"^(\s*)dist_autograd\.backward\(context_id, \[loss_fn\(outputs, labels\)\]\)",
                r'\1_loss = loss_fn(outputs, labels)\n\1print(f"loss b{i} {_loss.item():.6f}")\n'
                r"\1dist_autograd.backward(context_id, [_loss])",
                "probe: prints each batch's loss"),
               ("main.py", r"^batch_size = 120$", "batch_size = 40",
                "batches of 40 images instead of 120 (> 3 min on 2 cores)")],
        timeout=900,
        note="splits 1, 2, 4, 8 (3 batches each); torch alone is not bit-reproducible from the third "
             "batch on, even with one split (three torch runs, split 1: 0.132190, 0.131958, 0.132016): "
             "the losses after two SGD steps are compared within 1e-2, the others exactly"),
    Program(
        "ddp_rpc", "ddp_rpc", "main.py",
        metrics=[("loss", r"Training done for epoch \d+ loss " + NUM)],  # two trainers' lines may merge
        edits=[("main.py", r'print\("Training done for epoch \{\}"\.format\(epoch\)\)',
                'print("Training done for epoch {} loss {:.6f}".format(epoch, loss.item()))',
                "probe: prints the last loss of each epoch")],
        timeout=600, compare="none",
        note="two trainers update the shared embedding table asynchronously (which of them sees the "
             "other's update of a step first is a race), so the losses are compared by their mean"),
]

# --------------------------------------------------------------------------
# making the variants


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now.

    Example::

        >>> 1024 < free_port() < 65536
        True
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_variant(prog: Program, examples_dir: Path, dest: Path, impl: str,
                 ports: dict[str, str]) -> list[str]:
    """Copy ``prog``'s folder to ``dest`` and apply the edits; returns what was changed.

    Example::

        >>> make_variant(PROGRAMS[0], Path("examples/rpc"), Path("/tmp/v"), "distgrad",
        ...              {"29500": "41000"})
        ['main.py: port 29500 -> 41000 (1)', ...]
    """
    src = examples_dir / prog.folder
    if not src.is_dir():
        raise FileNotFoundError(f"{prog.name}: no folder {src}")
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__", "data"))
    changes = []
    applied = set()
    for path in sorted(dest.rglob("*.py")):
        rel = path.relative_to(dest).as_posix()
        text = path.read_text()
        rules = [(p, r, why) for f, p, r, why in prog.edits if f == rel]  # before the generic ones
        rules += [(p, r, f"CUDA {p!r}") for p, r in CUDA_EDITS]
        rules += [(rf"(?<=[:'\"]){old}(?=['\"])", new, f"port {old} -> {new}") for old, new in ports.items()]
        if impl == "distgrad":
            rules += [(p, r, f"import {p!r} -> {r}") for p, r in IMPORT_SWAPS]
        for pattern, repl, why in rules:
            text, n = re.subn(pattern, repl, text, flags=re.M)
            if n:
                changes.append(f"{rel}: {why} ({n})")
                applied.add(why)
        path.write_text(text)
    missing = [why for _f, _p, _r, why in prog.edits if why not in applied]
    if missing:
        raise ValueError(f"{prog.name}: edits that matched nothing (another version of it?): {missing}")
    return changes


def write_shims(shim_dir: Path, old_gym: bool) -> None:
    shim_dir.mkdir(parents=True, exist_ok=True)
    (shim_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    if old_gym:
        (shim_dir / "gym.py").write_text(OLD_GYM)

# --------------------------------------------------------------------------
# running


@dataclasses.dataclass
class Outcome:
    ok: bool
    seconds: float
    values: dict            # label -> [str]
    info: dict
    error: str = ""
    tracebacks: int = 0     # Python tracebacks in the log (a child can die while its launcher exits 0)


def run_variant(prog: Program, workdir: Path, shim_dir: Path, impl: str, distgrad_path: Path,
                seed: int, timeout: float, log: Path) -> Outcome:
    """Run one variant (all its processes) with a timeout and read its numbers."""
    env = dict(os.environ)
    paths = [str(shim_dir)] + ([str(distgrad_path)] if impl == "distgrad" else [])
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(PYTHONPATH=os.pathsep.join(paths), RTE_SEED=str(seed), RTE_TORCHVISION_FIX="1",
               PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    cmds = []
    base = [sys.executable, prog.script] + prog.argv
    if prog.per_rank:
        cmds = [base + [f"--rank={r}"] for r in range(prog.per_rank)]
    else:
        cmds = [base]
    start = time.monotonic()
    procs: list[subprocess.Popen] = []
    timed_out = False
    with open(log, "wb") as out:
        try:
            for cmd in cmds:
                procs.append(subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out,
                                              stderr=subprocess.STDOUT, start_new_session=True))
            deadline = start + timeout
            for p in procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    break
        finally:
            for p in procs:  # each command's own process group: the program and its children
                kill_group(p)
    seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    values = {m[0]: re.findall(m[1], text, re.M) for m in prog.metrics}
    info = {label: re.findall(rx, text, re.M) for label, rx in prog.info}
    rcs = [p.returncode for p in procs]
    tracebacks = (text.count("Traceback (most recent call last)")  # a remote one (distgrad) inside
                  - len(re.findall(r"^Remote traceback.*\nTraceback \(most recent", text, re.M)))
    if timed_out:
        return Outcome(False, seconds, values, info, f"timeout after {timeout:.0f} s", tracebacks)
    if any(rcs):
        return Outcome(False, seconds, values, info, f"exit {rcs}: {last_error(text)}", tracebacks)
    return Outcome(True, seconds, values, info, "", tracebacks)


def kill_group(p: subprocess.Popen) -> None:
    """End the process group that ``p`` leads (SIGTERM, then SIGKILL), and reap ``p``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            break
        if sig == signal.SIGTERM:
            time.sleep(0.5)
    p.wait()


def last_error(text: str) -> str:
    """The last line of the output that names an exception, else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception)\b", ln) or ln.startswith("torch.multiprocessing.spawn"):
            return ln[:200]
    return lines[-1][:200] if lines else "(no output)"

# --------------------------------------------------------------------------
# comparing and reporting


def summary(prog: Program, o: Outcome | None) -> str:
    if o is None:
        return "-"
    parts = []
    for label, vals in o.values.items():
        if vals:
            parts.append(f"{len(vals)}x {label}" if prog.compare == "count"
                         else f"{label} {vals[-1]}" + (f" ({len(vals)} values)" if len(vals) > 1 else ""))
    head = "; ".join(parts) or "no numbers"
    if o.tracebacks:
        head += f"; {o.tracebacks} tracebacks in the log"
    if not o.ok:
        head = f"FAIL: {o.error}" + (f" [{head}]" if parts else "")
    return f"{head}, {o.seconds:.0f} s"


def common_prefix(a: list, b: list) -> int:
    """How many leading values ``a`` and ``b`` share.

    Example::

        >>> common_prefix(["1", "2", "3"], ["1", "2", "4"])
        2
    """
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def max_rel_diff(a: list, b: list) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        fx, fy = float(x), float(y)
        if fx != fy:
            worst = max(worst, abs(fx - fy) / max(abs(fx), abs(fy), 1e-12))
    return worst


def mean(values: list[str]) -> float:
    return sum(map(float, values)) / len(values)


def same(prog: Program, a: Outcome | None, b: Outcome | None) -> str:
    """The verdict of the ``same?`` column for two runs of ``prog``.

    A metric ``(label, regex)`` must print identical values (all of them, or
    the first ``prog.exact_prefix``); ``(label, regex, rtol)`` must agree
    within that relative tolerance (torch's own run-to-run float noise).
    """
    if a is None or b is None or not a.ok or not b.ok:
        return "-"
    if prog.compare == "count":
        counts = all(len(a.values[k]) == len(b.values[k]) for k in a.values)
        return "yes (counts)" if counts else "no (counts)"
    total = sum(len(v) for v in a.values.values())
    if a.values == b.values:
        return f"yes ({total} values identical)" + (", by chance" if prog.compare == "none" else "")
    prefix = sum(common_prefix(a.values[k], b.values[k]) for k in a.values)
    if any(len(a.values[k]) != len(b.values[k]) for k in a.values):
        counts = ", ".join(f"{k}: {len(a.values[k])} vs {len(b.values[k])}" for k in a.values)
        return f"no (values printed: {counts}; first {prefix} identical)"
    worst = max(max_rel_diff(a.values[k], b.values[k]) for k in a.values)
    head = f"first {prefix}/{total} identical, then max rel diff {worst:.2g}"
    if prog.compare == "none":
        means = "; ".join(f"{k} mean {mean(a.values[k]):.4g} vs {mean(b.values[k]):.4g}" for k in a.values
                          if a.values[k] and b.values[k])
        return f"n/a ({head}; {means}; nondeterministic by design)"
    exact = tolerated = 0
    for metric in prog.metrics:
        va, vb = a.values[metric[0]], b.values[metric[0]]
        if len(metric) > 2:
            if max_rel_diff(va, vb) > metric[2]:
                return f"no ({metric[0]}: max rel diff {max_rel_diff(va, vb):.2g} > {metric[2]:g})"
            tolerated += len(va)
            continue
        need = min(len(va), prog.exact_prefix or len(va))
        if common_prefix(va, vb) < need:
            return ("close" if worst <= 1e-4 else "no") + f" ({head})"
        exact += need
    parts = [f"{exact} identical"]
    if tolerated:
        tol = max(max_rel_diff(a.values[m[0]], b.values[m[0]]) for m in prog.metrics if len(m) > 2)
        parts.append(f"{tolerated} within torch's own noise (max rel diff {tol:.2g})")
    if prog.exact_prefix and exact < total - tolerated:
        parts.append(f"{total - tolerated - exact} after those differ, see the note")
    return "yes (" + "; ".join(parts) + ")"


def table(rows: list[tuple[Program, Outcome | None, Outcome | None]]) -> str:
    lines = ["| program | torch: result, time | distgrad: result, time | same? |", "|---|---|---|---|"]
    for prog, t, d in rows:
        lines.append(f"| {prog.name} | {summary(prog, t)} | {summary(prog, d)} | {same(prog, t, d)} |")
    return "\n".join(lines)


def header(distgrad_path: Path, seed: int) -> str:
    """One line on what ran: torch version, distgrad's commit, seed, CPUs and load."""
    import torch
    try:
        rev = subprocess.run(["git", "-C", str(distgrad_path), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        rev = "?"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"torch {torch.__version__}; distgrad {distgrad_path} at {rev}; seed {seed}; "
            f"{os.cpu_count()} CPUs, load {load:.1f} at the end")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples-dir", required=True, type=Path,
                    help="a copy of pytorch/examples/distributed/rpc")
    ap.add_argument("--distgrad-path", type=Path, default=REPO,
                    help="the distgrad checkout put on PYTHONPATH (default: this repository)")
    ap.add_argument("--only", default="",
                    help="comma-separated program names (default: all but 'parameter_server x3')")
    ap.add_argument("--impl", default="torch,distgrad")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=0, help="seconds per run (default: each program's own)")
    ap.add_argument("--out", type=Path, default=None, help="folder for logs and results.md")
    ap.add_argument("--keep", action="store_true", help="keep the generated variants (under --out)")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the running programs are killed

    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - {p.name for p in PROGRAMS}
    if unknown:
        ap.error(f"unknown programs {sorted(unknown)}; known: {[p.name for p in PROGRAMS]}")
    progs = [p for p in PROGRAMS if p.name in names or (not names and p.default)]
    impls = [i for i in args.impl.split(",") if i]
    out = args.out or Path(tempfile.mkdtemp(prefix="rte-out-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rte-"))
    rows, all_ok = [], True
    try:
        for prog in progs:
            results: dict[str, Outcome] = {}
            for impl in impls:
                ports = {"29500": str(free_port()), "29501": str(free_port())}
                tag = prog.name.replace("/", "_")
                vdir = work / f"{tag}.{impl}"
                changes = make_variant(prog, args.examples_dir, vdir, impl, ports)
                write_shims(vdir / "_rte_shims", prog.old_gym)
                log = out / f"{tag}.{impl}.log"
                print(f"== {prog.name} [{impl}]: {len(changes)} edits; log {log}", flush=True)
                for c in changes:
                    print(f"   {c}", flush=True)
                o = run_variant(prog, vdir, vdir / "_rte_shims", impl, args.distgrad_path, args.seed,
                                args.timeout or prog.timeout, log)
                results[impl] = o
                all_ok &= o.ok
                print(f"   -> {summary(prog, o)}" + "".join(f"; {k}: {v}" for k, v in o.info.items()),
                      flush=True)
            rows.append((prog, results.get("torch"), results.get("distgrad")))
            if args.keep:
                shutil.copytree(work, out / "variants", dirs_exist_ok=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = (header(args.distgrad_path, args.seed) + "\n\n" + table(rows) + "\n\n"
              + "\n".join(f"- {p.name}: {p.note}" for p, _, _ in rows if p.note))
    (out / "results.md").write_text(report + "\n")
    print("\n" + report)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
