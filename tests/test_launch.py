"""Tests for distgrad.launch, torchrun's elastic agent behind a thin front (the
launcher and torchrun run as real subprocesses, each with a timeout)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mp_utils import SLOW, free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "launch_scripts"
LAUNCH = [sys.executable, "-m", "distgrad.launch"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signal semantics")


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["TMPDIR"] = str(tmp)  # torchrun's log directories (torchelastic_*) land here
    for key in ("DISTGRAD_SECRET", "OMP_NUM_THREADS", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"):
        env.pop(key, None)
    env.update(extra)
    return env


def _run_cmd(cmd: list[str], tmp: Path, timeout: float = 45, **extra: str) -> subprocess.CompletedProcess:
    """Run ``cmd``; on timeout SIGTERM it first so the agent can stop its workers."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(tmp, **extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=10)
        finally:
            proc.kill()
            proc.wait()
        raise AssertionError(f"{cmd} timed out\nstdout:\n{out}\nstderr:\n{err}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _run(args: list[str], tmp: Path, timeout: float = 45, **extra: str) -> subprocess.CompletedProcess:
    return _run_cmd(LAUNCH + args, tmp, timeout, **extra)


def _envs(stdout: str) -> dict[str, dict]:
    """``{prefix: {"env": ..., "argv": ...}}`` from print_env.py's lines."""
    return {ln.partition(": ")[0]: json.loads(ln.partition(": ENV ")[2])
            for ln in stdout.splitlines() if ": ENV " in ln}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not yet reaped by init) counts as gone
        with open(f"/proc/{pid}/status") as f:
            return not any(ln.startswith("State:") and "Z" in ln.split()[1] for ln in f)
    except OSError:
        return True


def _wait_gone(pids: list[int], timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _describe(left: list[int], pids: list[int]) -> str:
    """Which of ``pids`` (workers, then their children, in pairs) are ``left``: their
    command lines and states, for a failure's message."""
    out = []
    for p in left:
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = next(ln for ln in Path(f"/proc/{p}/status").read_text().splitlines()
                         if ln.startswith("State:"))
            ppid = next(ln for ln in Path(f"/proc/{p}/status").read_text().splitlines()
                        if ln.startswith("PPid:"))
        except (OSError, StopIteration):
            cmd, state, ppid = "?", "?", "?"
        role = "worker" if pids.index(p) % 2 == 0 else "worker's child"
        out.append(f"{p} ({role}): {cmd!r} {state} {ppid}")
    return "; ".join(out)


def _read_pids(pid_dir: Path, n: int, timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [pid_dir / f"pid{r}" for r in range(n)]
        if all(f.exists() for f in files):
            return [int(x) for f in files for x in f.read_text().split()]
        time.sleep(0.05)
    raise AssertionError(f"workers did not write pids: {list(pid_dir.iterdir())}")


@pytest.mark.timeout(60)
def test_env_vars_args_secret_and_prefix(tmp_path: Path) -> None:
    # one node, nothing given: the distgrad rendezvous in the agent, MASTER_ADDR 127.0.0.1, a free port
    res = _run(["--nproc-per-node", "3", str(SCRIPTS / "print_env.py"), "--foo", "bar baz", "-x"],
               tmp_path)
    assert res.returncode == 0, res.stderr
    seen = _envs(res.stdout)
    assert sorted(seen) == ["[rank0]", "[rank1]", "[rank2]"]
    ports, secrets, run_ids = set(), set(), set()
    for r in range(3):
        env = seen[f"[rank{r}]"]["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(r)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "3"
        assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"
        assert env["ROLE_NAME"] == "default"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["TORCHELASTIC_RESTART_COUNT"] == env["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert env["OMP_NUM_THREADS"] == "1"  # torchrun's default with several workers
        assert re.fullmatch(r"[0-9a-f]{64}", env["DISTGRAD_SECRET"])
        ports.add(env["MASTER_PORT"])
        secrets.add(env["DISTGRAD_SECRET"])
        run_ids.add(env["TORCHELASTIC_RUN_ID"])
        assert seen[f"[rank{r}]"]["argv"] == ["--foo", "bar baz", "-x"]
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    assert len(secrets) == 1 and len(run_ids) == 1  # one secret, one job, for all ranks
    for r in range(3):
        assert f"[rank{r}]: to-stderr" in res.stderr.splitlines()


@pytest.mark.timeout(60)
def test_static_port_secret_passthrough_and_module(tmp_path: Path) -> None:
    port = free_port()
    res = _run(["--nproc-per-node", "2", "--master-addr", "localhost", "--master-port", str(port),
                "-m", "tests.launch_scripts.print_env", "a"], tmp_path, DISTGRAD_SECRET="s3cret")
    assert res.returncode == 0, res.stderr
    infos = list(_envs(res.stdout).values())
    assert len(infos) == 2
    for info in infos:  # static rendezvous: the agent hosts the store on --master-port
        assert info["env"]["MASTER_ADDR"] == "localhost"
        assert info["env"]["MASTER_PORT"] == str(port)
        assert info["env"]["DISTGRAD_SECRET"] == "s3cret"
        assert info["argv"] == ["a"]


@pytest.mark.timeout(60)
def test_torchrun_log_options_pass_through(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    res = _run(["--nproc-per-node", "2", "--local-ranks-filter", "1", "--log-dir", str(logs),
                str(SCRIPTS / "print_env.py")], tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(_envs(res.stdout)) == ["[rank1]"]  # the console shows rank 1 only
    # torchrun's layout: <log-dir>/<run id>_<random>/attempt_<n>/<local rank>/stdout.log
    outs = sorted(logs.glob("*/attempt_0/*/stdout.log"))
    assert [p.parent.name for p in outs] == ["0", "1"]
    assert "ENV " in outs[0].read_text()


@pytest.mark.timeout(25 * SLOW + 30)
def test_failing_rank_stops_others(tmp_path: Path) -> None:
    start = time.monotonic()
    res = _run(["--nproc-per-node", "3", str(SCRIPTS / "fail_one.py"), str(tmp_path)], tmp_path,
               timeout=25 * SLOW)
    elapsed = time.monotonic() - start
    assert res.returncode == 3, res.stderr  # the failed worker's exit code (torchrun: 1)
    assert elapsed < 20 * SLOW  # a hang guard: the others would sleep forever
    assert "[rank1]: rank1 failing" in res.stdout
    # torchrun's ChildFailedError report, root cause last
    root = res.stderr.split("Root Cause")[-1]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", root) and re.search(r"exitcode\s*: 3", root)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(3)]
    assert _wait_gone(pids) == []


@pytest.mark.timeout(60)
def test_sigkill_after_shutdown_timeout(tmp_path: Path) -> None:
    proc = subprocess.Popen(LAUNCH + ["--nproc-per-node", "2", "--shutdown-timeout", "1",
                                      str(SCRIPTS / "sleep_forever.py"), str(tmp_path), "ignore-term"],
                            cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        pids = _read_pids(tmp_path, 2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 143, err
        assert _wait_gone(pids) == []
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_kills_all_children(tmp_path: Path, sig: int, code: int) -> None:
    proc = subprocess.Popen(LAUNCH + ["--nproc-per-node", "3", str(SCRIPTS / "sleep_forever.py"),
                                      str(tmp_path)],
                            cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        pids = _read_pids(tmp_path, 3)  # 3 workers + 3 grandchildren
        assert len(pids) == 6 and all(_alive(p) for p in pids)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == code, err
        left = _wait_gone(pids)
        assert left == [], _describe(left, pids)   # (once, in a quiet suite run: one left)
        assert b"[rank2]: ready" in out
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(60)
def test_torch_rpc_script_under_distgrad_launch(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.rpc")
    res = _run(["--nproc-per-node", "2", str(SCRIPTS / "torch_rpc.py")], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[rank0]: RESULT rank=0 [2.0, 2.0]" in res.stdout
    assert "[rank1]: RESULT rank=1 [3.0, 3.0]" in res.stdout


@pytest.mark.timeout(60)
def test_torch_rpc_script_under_torchrun(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.rpc")
    res = _run_cmd(TORCHRUN + ["--nproc-per-node", "2", "--master-port", str(free_port()),
                               str(SCRIPTS / "torch_rpc.py")], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "RESULT rank=0 [2.0, 2.0]" in res.stdout
    assert "RESULT rank=1 [3.0, 3.0]" in res.stdout


@pytest.mark.parametrize("argv,message", [
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 is out of range for --nnodes 2"),
    (["--nnodes", "2", "--node-rank", "-1"], "--node-rank -1 is out of range"),
    (["--nnodes", "2", "--node_rank", "1"], "--node-rank 1 of --nnodes 2 needs --master-addr"),
    (["--nnodes", "1:4"], "--nnodes 1:4: several nodes meet at --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "1:4", "--rdzv-endpoint", "h:1"], "--nnodes 1:4: give --rdzv-id JOB"),
    (["--nnodes", "1:4", "--rdzv-backend", "static"], "--nnodes 1:4 is an elastic range"),
    (["--nnodes", "2", "--standalone"], "--standalone is one node"),
    (["--nnodes", "0"], "--nnodes 0: need 1 <= MIN <= MAX"),
    (["--nnodes", "3:2"], "--nnodes 3:2: need 1 <= MIN <= MAX"),
    (["--nnodes", "two"], "--nnodes must be N or MIN:MAX"),
    (["--nproc-per-node", "0"], "--nproc-per-node must be a number >= 1"),
    (["--max-restarts", "-1"], "--max-restarts must be >= 0"),
    (["--master-port", "70000"], "--master-port must be in 1..65535"),
])
def test_bad_arguments_are_refused(capsys, argv, message) -> None:
    from distgrad.launch.launcher import main
    assert main([*argv, "never_started.py"]) == 2
    assert f"distgrad launch: {message}" in capsys.readouterr().err


def test_cli_launch_is_torchruns_parser() -> None:
    from torch.distributed.run import get_args_parser

    from distgrad.cli import build_parser
    from distgrad.launch import build_parser as build_launch_parser
    argv = ["--nnodes", "1:2", "--max-restarts", "2", "--rdzv-backend", "c10d", "-m",
            "pkg.train", "--lr", "1"]
    cli = vars(build_parser().parse_args(["launch", *argv]))
    assert cli.pop("command") == "launch"
    assert cli == vars(build_launch_parser().parse_args(argv))
    assert (cli["nnodes"], cli["max_restarts"], cli["rdzv_backend"], cli["module"]) == \
        ("1:2", 2, "c10d", True)
    assert (cli["training_script"], cli["training_script_args"]) == ("pkg.train", ["--lr", "1"])
    torchrun = vars(get_args_parser().parse_args(argv))
    assert cli.keys() == torchrun.keys()  # every torchrun option, no more
    # distgrad's defaults differ only where "not given" must be seen (filled in by launch)
    assert {k for k in cli if cli[k] != torchrun[k]} == {"tee", "master_addr"}
    # ... and the rendezvous backend, when none is named (distgrad's, in launch)
    plain = ["train.py"]
    assert vars(build_launch_parser().parse_args(plain))["rdzv_backend"] is None
    assert vars(get_args_parser().parse_args(plain))["rdzv_backend"] == "static"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("front", ["torchrun", "distgrad launch", "distgrad launch, one node"])
def test_elastic_restart_after_a_lost_rank(tmp_path: Path, front: str) -> None:
    """--nnodes 1:2 --max-restarts 1 (torchrun: its c10d rendezvous; distgrad launch:
    the distgrad one, by default): rank 1 SIGKILLs itself in the middle of attempt
    0; the agent tears the group down and restarts it, and attempt 1 comes back as
    a fresh distgrad group on the same agent store."""
    backend = ["--rdzv-backend", "c10d"] if front == "torchrun" else ["--rdzv-id", "job3"]
    nodes = ["--nnodes", "1:2", *backend, "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    if front.endswith("one node"):   # the default: the rendezvous state in the agent
        nodes = []
    cmd = (TORCHRUN if front == "torchrun" else [sys.executable, "-m", "distgrad", "launch"]) + [
        *nodes, "--nproc-per-node", "2", "--max-restarts", "1",
        # the round closes once min nodes joined and last_call passed (30 s by default)
        "--rdzv-conf", "last_call_timeout=1", "--monitor-interval", "0.1",
        str(SCRIPTS / "elastic_restart.py"), str(tmp_path)]
    extra = {"OMP_NUM_THREADS": "1"}
    if front == "torchrun":  # torchrun makes up no secret
        extra["DISTGRAD_SECRET"] = "distgrad-tests"
    res = _run_cmd(cmd, tmp_path, 75, **extra)
    story = f"rc={res.returncode}\n--- stdout ---\n{res.stdout}\n--- stderr ---\n{res.stderr[-4000:]}"
    assert res.returncode == 0, story
    for rank in range(2):
        assert f"DONE rank={rank} attempt=1 steps=5" in res.stdout, story
        assert f"DONE rank={rank} attempt=0" not in res.stdout, story
    for step in range(5):
        assert f"GRAD OK rank=0 attempt=1 step={step}" in res.stdout, story
    assert "GRAD OK rank=0 attempt=0 step=2" in res.stdout, story  # attempt 0 ran until rank 1 died
    assert "attempt=0 step=3" not in res.stdout, story
    stores = set(re.findall(r"START rank=\d attempt=\d store=(\S+) agent_store=True", res.stdout))
    # torchrun keeps one agent store for both attempts; the distgrad rendezvous hosts
    # a fresh one every round (no key of the last group is left for the next)
    assert len(re.findall("START ", res.stdout)) == 4, story
    assert len(stores) == (1 if front == "torchrun" else 2), story
    if front != "torchrun":
        assert "[rank1]: DONE rank=1 attempt=1 steps=5" in res.stdout, story
    pids = [int((tmp_path / f"pid{r}.{a}").read_text()) for r in range(2) for a in range(2)]
    assert _wait_gone(pids) == []
