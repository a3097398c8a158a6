"""Tests for distgrad.launch (the launcher runs as a real subprocess)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "launch_scripts"
LAUNCH = [sys.executable, "-m", "distgrad.launch"]

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signal semantics")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.pop("DISTGRAD_SECRET", None)
    env.update(extra)
    return env


def _run_cmd(cmd: list[str], timeout: float = 45, **extra: str) -> subprocess.CompletedProcess:
    """Run ``cmd``; on timeout SIGTERM it first so a launcher can clean up its workers."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(**extra), stdout=subprocess.PIPE,
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


def _run(args: list[str], timeout: float = 45, **extra: str) -> subprocess.CompletedProcess:
    return _run_cmd(LAUNCH + args, timeout, **extra)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def _read_pids(pid_dir: Path, n: int, timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [pid_dir / f"pid{r}" for r in range(n)]
        if all(f.exists() for f in files):
            return [int(x) for f in files for x in f.read_text().split()]
        time.sleep(0.05)
    raise AssertionError(f"workers did not write pids: {list(pid_dir.iterdir())}")


@pytest.mark.timeout(60)
def test_env_vars_args_and_prefix() -> None:
    res = _run(["--nproc-per-node", "3", "--master-port", "29123",
                str(SCRIPTS / "print_env.py"), "--foo", "bar baz", "-x"])
    assert res.returncode == 0, res.stderr
    seen = {}
    for line in res.stdout.splitlines():
        prefix, _, rest = line.partition(": ")
        if rest.startswith("ENV "):
            seen[prefix] = json.loads(rest[4:])
    assert sorted(seen) == ["[rank0]", "[rank1]", "[rank2]"]
    secrets = set()
    for r in range(3):
        info = seen[f"[rank{r}]"]
        env = info["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(r)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["GROUP_RANK"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["MASTER_PORT"] == "29123"
        assert env["PYTHONUNBUFFERED"] == "1"
        assert len(env["DISTGRAD_SECRET"]) == 64
        secrets.add(env["DISTGRAD_SECRET"])
        assert info["argv"] == ["--foo", "bar baz", "-x"]
    assert len(secrets) == 1  # one secret shared by all ranks
    for r in range(3):
        assert f"[rank{r}]: to-stderr" in res.stderr.splitlines()


@pytest.mark.timeout(60)
def test_default_port_secret_passthrough_and_module() -> None:
    res = _run(["--nproc-per-node", "2", "--master-addr", "localhost", "-m",
                "tests.launch_scripts.print_env", "a"], DISTGRAD_SECRET="s3cret")
    assert res.returncode == 0, res.stderr
    infos = [json.loads(ln.partition(": ")[2][4:]) for ln in res.stdout.splitlines()
             if ": ENV " in ln]
    assert len(infos) == 2
    ports = {i["env"]["MASTER_PORT"] for i in infos}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    assert all(i["env"]["DISTGRAD_SECRET"] == "s3cret" for i in infos)
    assert all(i["env"]["MASTER_ADDR"] == "localhost" for i in infos)
    assert all(i["argv"] == ["a"] for i in infos)


@pytest.mark.timeout(60)
def test_failing_rank_kills_others(tmp_path: Path) -> None:
    start = time.monotonic()
    res = _run(["--nproc-per-node", "3", str(SCRIPTS / "fail_one.py"), str(tmp_path)])
    elapsed = time.monotonic() - start
    assert res.returncode == 3, res.stderr
    assert elapsed < 20
    assert "[rank1]: rank1 failing" in res.stdout
    assert "rank 1" in res.stderr and "exit code 3" in res.stderr
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(3)]
    assert _wait_gone(pids) == []


@pytest.mark.timeout(60)
def test_sigkill_after_grace_period(tmp_path: Path) -> None:
    proc = subprocess.Popen(LAUNCH + ["--nproc-per-node", "2", "--grace-period", "1",
                                      str(SCRIPTS / "sleep_forever.py"), str(tmp_path), "ignore-term"],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
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
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        pids = _read_pids(tmp_path, 3)  # 3 workers + 3 grandchildren
        assert len(pids) == 6 and all(_alive(p) for p in pids)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == code, err
        assert _wait_gone(pids) == []
        assert b"[rank2]: ready" in out
    finally:
        proc.kill()
        proc.wait()


def _check_rpc_output(stdout: str) -> None:
    assert "[rank0]: RESULT rank=0 [2.0, 2.0]" in stdout
    assert "[rank1]: RESULT rank=1 [3.0, 3.0]" in stdout


@pytest.mark.timeout(60)
def test_torch_rpc_script_under_distgrad_launch() -> None:
    pytest.importorskip("torch.distributed.rpc")
    res = _run(["--nproc-per-node", "2", str(SCRIPTS / "torch_rpc.py")])
    assert res.returncode == 0, res.stdout + res.stderr
    _check_rpc_output(res.stdout)


@pytest.mark.timeout(60)
def test_torch_rpc_script_under_torchrun() -> None:
    pytest.importorskip("torch.distributed.rpc")
    res = _run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-port", str(_free_port()), str(SCRIPTS / "torch_rpc.py")])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "RESULT rank=0 [2.0, 2.0]" in res.stdout
    assert "RESULT rank=1 [3.0, 3.0]" in res.stdout


@pytest.mark.parametrize("argv,message", [
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 is out of range for --nnodes 2"),
    (["--nnodes", "2", "--node-rank", "-1"], "--node-rank -1 is out of range"),
    (["--nnodes", "2", "--node_rank", "1"], "--node-rank 1 of --nnodes 2 needs --master-addr"),
    (["--nnodes", "1:4"], "elastic node ranges are not supported"),
    (["--nnodes", "0"], "--nnodes must be >= 1"),
    (["--nnodes", "two"], "--nnodes must be N or N:N"),
    (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1"),
])
def test_bad_multi_node_arguments_are_refused(capsys, argv, message) -> None:
    from distgrad.launch.launcher import main
    assert main([*argv, "never_started.py"]) == 2
    assert message in capsys.readouterr().err


def test_multi_node_worker_env_is_torchruns() -> None:
    # the names and values torchrun's agent gives (static rendezvous, default role)
    from distgrad.launch.launcher import worker_env
    env = worker_env(nnodes=3, node_rank=1, nproc=2, local_rank=1)
    assert env == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2",
                   "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "3", "ROLE_RANK": "3",
                   "ROLE_WORLD_SIZE": "6", "ROLE_NAME": "default"}


@pytest.mark.timeout(60)
def test_second_node_env_and_prefixes() -> None:
    # node 1 of 2 on its own: its workers get ranks 2..3 (they only print, no rendezvous)
    res = _run(["--nnodes", "2:2", "--node-rank", "1", "--nproc-per-node", "2", "--master-addr",
                "10.1.2.3", str(SCRIPTS / "print_env.py")], DISTGRAD_SECRET="shared")
    assert res.returncode == 0, res.stderr
    seen = {ln.partition(": ")[0]: json.loads(ln.partition(": ")[2][4:])["env"]
            for ln in res.stdout.splitlines() if ": ENV " in ln}
    assert sorted(seen) == ["[rank2]", "[rank3]"]
    for local in range(2):
        env = seen[f"[rank{2 + local}]"]
        assert env["RANK"] == str(2 + local) and env["LOCAL_RANK"] == str(local)
        assert env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "1" and env["GROUP_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "10.1.2.3" and env["MASTER_PORT"] == "29500"
        assert env["DISTGRAD_SECRET"] == "shared"
