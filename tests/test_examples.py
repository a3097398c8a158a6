"""Each example runs as its own command, exits 0 and prints a falling loss."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
TIMEOUT = 240          # each example takes seconds on an idle machine; CI boxes are not idle
LOSS_RE = re.compile(r"^(?P<who>\S+)?\s*step\s+(?P<step>\d+)\s+loss\s+(?P<loss>[0-9.eE+-]+)\s*$")


NO_SECRET = "no cluster secret"   # distgrad's warning when a cluster runs without one


def run_example(name: str, *args: str) -> str:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("DISTGRAD_SECRET", None)   # the example sets its own, as the README advises
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{proc.stdout[-5000:]}"
    assert NO_SECRET not in proc.stdout, proc.stdout[-5000:]
    return proc.stdout


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py")))
def test_each_example_sets_the_cluster_secret_by_its_imports(name):
    """Beside the imports (the top level, or the distgrad branch of the migration's),
    before anything starts, a line that says how, then the secret set where the
    workers it spawns inherit it."""
    import ast
    with open(os.path.join(EXAMPLES, name)) as f:
        src = f.read()
    tree = ast.parse(src)
    top = list(tree.body) + [n for i in tree.body if isinstance(i, ast.If) for n in i.orelse]
    sets = [n for n in top if isinstance(n, ast.Expr) and ast.unparse(n) ==
            "os.environ.setdefault('DISTGRAD_SECRET', secrets.token_hex(32))"]
    assert len(sets) == 1, name
    line = src.splitlines()[sets[0].lineno - 2]
    assert line.strip().startswith("# every worker needs the same DISTGRAD_SECRET"), line
    first_def = min(n.lineno for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
    assert sets[0].lineno < first_def, name


def losses(output: str) -> dict[str, list[float]]:
    """``who -> [loss, ...]`` from lines like ``trainer1 step   10 loss 0.123``."""
    out: dict[str, list[float]] = defaultdict(list)
    for line in output.splitlines():
        m = LOSS_RE.match(line.strip())
        if m:
            out[m["who"] or "main"].append(float(m["loss"]))
    return dict(out)


def assert_falls(output: str, expected_series: int, factor: float = 0.7) -> dict[str, list[float]]:
    series = losses(output)
    assert len(series) == expected_series, output
    for who, vals in series.items():
        assert len(vals) >= 3, (who, vals, output)
        assert vals[-1] < factor * vals[0], f"{who}: loss did not fall: {vals}"
    return series


@pytest.mark.timeout(TIMEOUT + 30)
def test_parameter_server():
    out = run_example("parameter_server.py")
    series = assert_falls(out, expected_series=2)
    assert set(series) == {"trainer1", "trainer2"}


@pytest.mark.timeout(TIMEOUT + 30)
def test_model_parallel_rnn():
    out = run_example("model_parallel_rnn.py")
    assert_falls(out, expected_series=1)
    assert "emb_worker" in out and "lstm_worker" in out


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("flag", ["", "--torch"])
def test_migrate_from_torch(flag):
    out = run_example("migrate_from_torch.py", *([flag] if flag else []))
    expected = "torch.distributed.rpc" if flag else "distgrad.rpc"
    assert f"backend: {expected}" in out
    assert_falls(out, expected_series=1)
    assert "done" in out


def test_migration_differs_only_in_imports():
    """The distgrad-specific lines of the migration script are its three imports."""
    with open(os.path.join(EXAMPLES, "migrate_from_torch.py")) as f:
        src = f.read()
    body = src.split("# ------------------------- unchanged torch.distributed.rpc code")[1]
    assert "distgrad" not in body
    distgrad_imports = [ln.strip() for ln in src.splitlines()
                        if ln.strip().startswith(("import distgrad.", "from distgrad."))]
    assert sorted(distgrad_imports) == sorted(["import distgrad.rpc as rpc",
                                               "import distgrad.autograd as dist_autograd",
                                               "from distgrad.optim import DistributedOptimizer"])


@pytest.mark.timeout(TIMEOUT + 30)
def test_the_readmes_first_example_runs_as_it_says(tmp_path):
    """The example that opens the README's "Use", run as its launcher would (RANK,
    MASTER_ADDR/PORT, a secret), prints what its comment says."""
    import secrets
    import socket
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    use = readme[readme.index("\n## Use\n"):]
    code = use[use.index("```python\n") + len("```python\n"):]
    code = code[:code.index("```")]
    assert "rpc.init_rpc" in code and "# tensor([2., 2., 2.])" in code, code
    (tmp_path / "train.py").write_text(code)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
               DISTGRAD_SECRET=secrets.token_hex(32), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "train.py"], cwd=tmp_path, text=True,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    try:
        outs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0].strip().splitlines()[-1] == "tensor([2., 2., 2.])", outs
    assert outs[1].strip() == "", outs
