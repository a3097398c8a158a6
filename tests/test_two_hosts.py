"""Two "hosts" on one machine: two network namespaces joined by a veth pair.

Each namespace runs one node of a 4-worker cluster (2 workers each), started
by `distgrad launch --nnodes 2` or torchrun's multi-node flags. Workers in
different namespaces must talk TCP over the veth (no Unix socket, no shared
memory: the host key includes the network namespace), and the loss of one
node must reach the other's workers through heartbeats.

Needs root, the ``ip`` command and the capabilities to create namespaces and
links: skipped (saying which is missing) where the platform forbids it. Where
it allows it (CI runs as root), failing to build the namespaces is a failure.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mp_utils import SLOW

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve().parent / "launch_scripts" / "two_hosts.py"
ADDR_A, ADDR_B = "10.213.0.1", "10.213.0.2"
PORT = 29500  # fresh namespaces: nothing else listens there
# a hang guard per launcher: a loaded 2-core machine took 70 s once, and may be slower still
TIMEOUT = 60 * SLOW

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="network namespaces are Linux's")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


def _ns_pids(ns: str) -> list[int]:
    res = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split()]


def _kill_ns_processes(ns: str) -> list[int]:
    """SIGKILL every process in ``ns`` (all started by this test); returns their pids."""
    pids = _ns_pids(ns)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def test_listen_address_choice(monkeypatch) -> None:
    from distgrad.errors import DistgradError
    from distgrad.transport import netaddr
    for var in netaddr.IFNAME_VARS:
        monkeypatch.delenv(var, raising=False)
    assert netaddr.listen_address(None, None) == "127.0.0.1"
    assert netaddr.listen_address(None, "localhost") == "127.0.0.1"  # the route to it
    assert netaddr.listen_address("10.9.9.9", "127.0.0.1") == "10.9.9.9"  # explicit wins
    monkeypatch.setenv("TP_SOCKET_IFNAME", "lo")  # torch's variable, when distgrad's is unset
    assert netaddr.listen_address(None, "10.213.0.1") == "127.0.0.1"
    monkeypatch.setenv("DISTGRAD_SOCKET_IFNAME", "nosuchif0")
    with pytest.raises(DistgradError, match="no network interface named 'nosuchif0'"):
        netaddr.listen_address(None, "127.0.0.1")
    assert netaddr.is_loopback("127.0.1.1") and netaddr.is_loopback("[::1]")
    assert not netaddr.is_loopback(ADDR_A)


_CAPS = {"CAP_NET_ADMIN": 12, "CAP_SYS_ADMIN": 21}  # links and addresses; `ip netns add`


def _forbidden() -> str | None:
    """Why this platform cannot build network namespaces; None where it can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    with open("/proc/self/status") as f:
        eff = int(next(line for line in f if line.startswith("CapEff:")).split()[1], 16)
    missing = [name for name, bit in _CAPS.items() if not eff >> bit & 1]
    if missing:
        return f"root without {' and '.join(missing)} (an unprivileged container)"
    return None


def _ip_or_fail(*args: str) -> None:
    res = _ip(*args, check=False)
    if res.returncode != 0:
        pytest.fail(f"`ip {' '.join(args)}` failed as root with the capabilities it needs: "
                    f"{res.stderr.strip()}")


def test_skipped_only_where_the_platform_forbids_namespaces(monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert _forbidden() == "needs root to create network namespaces"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert _forbidden() == "no `ip` command (iproute2)"


@pytest.fixture
def hosts():
    """Namespaces ``(ns_a, ns_b)`` with lo up and a veth ``dg0`` in each
    (ADDR_A/24, ADDR_B/24); removed, with any process left in them, afterwards."""
    why = _forbidden()
    if why:
        pytest.skip(why)
    suffix = secrets.token_hex(3)
    ns_a, ns_b = f"dgA{suffix}", f"dgB{suffix}"
    made: list[str] = []
    try:
        for ns in (ns_a, ns_b):
            _ip_or_fail("netns", "add", ns)
            made.append(ns)
        _ip_or_fail("link", "add", "dg0", "netns", ns_a, "type", "veth", "peer", "name", "dg0",
                    "netns", ns_b)
        for ns, addr in ((ns_a, ADDR_A), (ns_b, ADDR_B)):
            _ip_or_fail("-n", ns, "link", "set", "lo", "up")
            _ip_or_fail("-n", ns, "addr", "add", f"{addr}/24", "dev", "dg0")
            _ip_or_fail("-n", ns, "link", "set", "dg0", "up")
        yield ns_a, ns_b
    finally:
        for ns in made:
            pids = _kill_ns_processes(ns)
            deadline = time.monotonic() + 5
            while pids and _ns_pids(ns) and time.monotonic() < deadline:
                time.sleep(0.05)
            _ip("netns", "del", ns, check=False)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["DISTGRAD_SECRET"] = "two-hosts-test"  # the same on both nodes
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _start(ns: str, cmd: list[str], **extra: str) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], cwd=ROOT, env=_env(**extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # the fixture kills what it left in its namespace
        out, err = proc.communicate()
        raise AssertionError(f"{proc.args} timed out\nstdout:\n{out}\nstderr:\n{err}") from None
    return proc.returncode, out, err


def _distgrad_launch(node_rank: int, *script_args: str) -> list[str]:
    return [sys.executable, "-m", "distgrad", "launch", "--nnodes", "2", "--node-rank",
            str(node_rank), "--nproc-per-node", "2", "--master-addr", ADDR_A, "--master-port",
            str(PORT), str(SCRIPT), *script_args]


def _torchrun(node_rank: int, *script_args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
            str(node_rank), "--nproc-per-node", "2", "--master-addr", ADDR_A, "--master-port",
            str(PORT), str(SCRIPT), *script_args]


def _rank_env(nnodes: int, node_rank: int, nproc: int, local_rank: int) -> dict[str, str]:
    """The rank variables torchrun's agent gives one worker (one group a node, default role)."""
    world, rank = nnodes * nproc, node_rank * nproc + local_rank
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(node_rank),
            "GROUP_WORLD_SIZE": str(nnodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
            "ROLE_NAME": "default"}


def _check_train(results) -> None:
    out = "".join(r[1] for r in results)
    for code, o, e in results:
        assert code == 0, f"exit code {code}\nstdout:\n{o}\nstderr:\n{e}"
    _check_train_output(out)
    _check_trace_clocks(out)


def _check_train_output(out: str) -> None:
    assert out.count("GRADS OK") == 1, out
    for rank in range(4):
        assert f"LINKS OK rank={rank}" in out, out


def _check_trace_clocks(out: str) -> None:
    # distgrad.trace's clock estimate across the namespaces (issue 28): one kernel clock,
    # so every offset is zero within the error the trace states for it
    line = next((ln for ln in out.splitlines() if ln.startswith("TRACE CLOCKS ")), None)
    assert line is not None, out
    clock = json.loads(line[len("TRACE CLOCKS "):])
    assert sorted(clock) == [f"worker{r}" for r in range(4)], clock
    for name, c in clock.items():
        assert abs(c["offset_us"]) <= c["error_us"] or name == "worker0", (name, c)
        assert name != "worker0" or c["offset_us"] == 0, c


@pytest.mark.timeout(TIMEOUT + 60)
def test_torchrun_multi_node_across_two_hosts(hosts) -> None:
    """torchrun's own agents (static rendezvous; node 0's hosts the store on
    MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE) start distgrad workers."""
    # workers listen on the interface named as torch's TP_SOCKET_IFNAME would name it
    procs = [_start(ns, _torchrun(r, "train", ADDR_A, ADDR_B), DISTGRAD_SOCKET_IFNAME="dg0")
             for r, ns in enumerate(hosts)]
    results = [_finish(p, TIMEOUT) for p in procs]
    _check_train(results)
    # torchrun's rank variables (no NODE_RANK)
    envs = [json.loads(ln.split("ENV ", 1)[1]) for _, out, _ in results
            for ln in out.splitlines() if "ENV {" in ln]
    assert len(envs) == 4
    for env in envs:
        node, local = int(env["GROUP_RANK"]), int(env["LOCAL_RANK"])
        assert env == dict(_rank_env(2, node, 2, local), NODE_RANK=None), env
    for ns in hosts:  # the agents reaped every worker they started
        assert _ns_pids(ns) == [], f"processes left in {ns}"


@pytest.mark.timeout(TIMEOUT + 30 * SLOW + 80)
def test_distgrad_launch_across_two_hosts_then_one_is_lost(hosts, tmp_path: Path) -> None:
    """Train across the hosts; then host B vanishes (link down, processes killed:
    no FIN reaches A) and A's workers learn it from heartbeats, not timeouts."""
    ns_a, ns_b = hosts
    procs = [_start(ns, _distgrad_launch(r, "train+lose", ADDR_A, ADDR_B, str(tmp_path)))
             for r, ns in enumerate(hosts)]
    try:
        deadline = time.monotonic() + TIMEOUT
        while not all((tmp_path / f"ready{r}").exists() for r in range(4)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                for p in procs:
                    p.kill()
                outs = [p.communicate() for p in procs]
                raise AssertionError(f"workers never got ready: {outs}")
            time.sleep(0.05)
        # host B vanishes: its end of the wire first (no FIN, no RST reaches A; A keeps
        # its address, so node 0's store still works), then its processes
        cut = time.time()
        _ip("-n", ns_b, "link", "set", "dg0", "down")
        assert _kill_ns_processes(ns_b)
        code_b, out_b, _ = _finish(procs[1], 10)
        code_a, out_a, err_a = _finish(procs[0], 30 * SLOW)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    _check_train_output(out_a + out_b)
    # the launcher's prefixes carry global ranks: node 1 runs ranks 2 and 3
    assert "[rank2]: LINKS OK rank=2" in out_b and "[rank0]: GRADS OK" in out_a
    assert code_b == -signal.SIGKILL
    lost = {int(m[0]): (m[1], float(m[2])) for m in
            re.findall(r"LOST rank=(\d) worker=(\w+) at=([\d.]+)", out_a)}
    assert sorted(lost) == [0, 1], f"stdout:\n{out_a}\nstderr:\n{err_a}"
    for rank, (worker, at) in lost.items():
        assert worker == f"worker{rank + 2}"
        # the heartbeat deadline is 4 s (interval 0.5 s); the call's timeout is 60 s:
        # the upper bound, SLOW times 15 s, stays below the latter
        assert 3.0 < at - cut < 15.0 * SLOW, (rank, at - cut, out_a)
    print(f"\nhost loss noticed after {max(at for _, at in lost.values()) - cut:.2f} s")
    assert "no heartbeat" in out_a, out_a
    # node 0's launcher (torchrun's agent) reports its workers' exit (code 17 after a
    # clean shutdown) in its ChildFailedError report and exits with it
    assert code_a == 17, err_a
    assert re.search(r"exitcode\s*: 17", err_a), err_a
    assert _ns_pids(ns_a) == []
