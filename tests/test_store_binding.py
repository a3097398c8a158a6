"""A store listens where the user said, and nowhere else (issue 35, item 2).

Two network namespaces joined by a veth (``test_two_hosts``'s fixture): the store
runs in namespace A, a client tries it from namespace B through A's veth address.
``distgrad store`` bound to 127.0.0.1 (its default) and rank 0's own store for
``env://`` with ``MASTER_ADDR=127.0.0.1`` are unreachable from B (before, torch
listened on ``::``, every interface); ``distgrad store --host <A's address>`` is
reachable from B. Each is a real process; skipped, with the reason, only where
namespaces cannot be created.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from test_two_hosts import ADDR_A, _env, hosts  # noqa: F401 - hosts: the fixture

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(sys.platform != "linux", reason="network namespaces are Linux's")]

PORT = 29511   # fresh namespaces: nothing else listens there

_RANK0_STORE = """
import os, sys, time
from distgrad.launch.rendezvous import make_store
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
store = make_store("env://", 0, 2, 30.0, name="worker0")
store.set("up", "1")
print("ready", flush=True)
time.sleep(60)
"""

_PROBE = """
import socket, sys
from datetime import timedelta
import torch.distributed as dist
host, port = sys.argv[1], int(sys.argv[2])
try:
    socket.create_connection((host, port), timeout=5).close()
except OSError as e:
    print("unreachable", type(e).__name__, flush=True)
    sys.exit(0)
store = dist.TCPStore(host, port, None, is_master=False, timeout=timedelta(seconds=10),
                      wait_for_workers=False)
store.set("probe", "1")
print("reachable", store.get("probe").decode(), flush=True)
"""


def _in(ns: str, *cmd: str) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *cmd], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _probe(ns: str, host: str, port: int) -> str:
    proc = _in(ns, "-c", _PROBE, host, str(port))
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 0, (out, err)
    return out.strip()


def _serving(proc: subprocess.Popen, ns: str, port: int, what: str) -> None:
    """Wait until ``proc`` (in ``ns``) serves its store on 127.0.0.1 or its address."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{what} exited: {proc.communicate()}"
        if _listening(ns, port):
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} did not listen on {port} within 30 s")


def _listening(ns: str, port: int) -> str:
    res = subprocess.run(["ip", "netns", "exec", ns, "ss", "-ltnH", f"sport = :{port}"],
                         capture_output=True, text=True, timeout=10)
    return " ".join(line.split()[3] for line in res.stdout.splitlines())


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.communicate(timeout=10)


@pytest.mark.parametrize("how", ["distgrad store", "rank 0's env:// store"])
def test_a_store_bound_to_loopback_is_unreachable_from_another_host(hosts, how):  # noqa: F811
    ns_a, ns_b = hosts
    if how == "distgrad store":
        proc = _in(ns_a, "-m", "distgrad", "store", "--port", str(PORT))
    else:
        proc = _in(ns_a, "-c", _RANK0_STORE, str(PORT))
    try:
        _serving(proc, ns_a, PORT, how)
        assert _listening(ns_a, PORT) == f"127.0.0.1:{PORT}"
        assert _probe(ns_a, "127.0.0.1", PORT) == "reachable 1"      # it serves
        assert _probe(ns_b, ADDR_A, PORT).startswith("unreachable"), how
    finally:
        _stop(proc)


def test_a_store_bound_to_an_address_is_reachable_there(hosts):  # noqa: F811
    ns_a, ns_b = hosts
    proc = _in(ns_a, "-m", "distgrad", "store", "--host", ADDR_A, "--port", str(PORT))
    try:
        _serving(proc, ns_a, PORT, "distgrad store")
        assert _listening(ns_a, PORT) == f"{ADDR_A}:{PORT}"
        assert _probe(ns_b, ADDR_A, PORT) == "reachable 1"
        assert _probe(ns_a, "127.0.0.1", PORT).startswith("unreachable")   # only what was named
    finally:
        _stop(proc)


def _reaches(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except OSError:
        return False


def test_a_loopback_store_listens_on_its_address_alone_and_a_held_port_is_refused():
    """Without namespaces (issue 35's audit, poc_store_binding_addresses.py): every
    127.x.y.z address reaches this machine's loopback, so a store bound to 127.0.0.1
    must refuse 127.0.0.2 (a wildcard listener would take it); and a port another
    program holds on 127.0.0.1 makes the store fail, never fall back elsewhere."""
    from datetime import timedelta

    from mp_utils import free_port

    from distgrad.launch.listen import host_store
    port = free_port()
    store = host_store("127.0.0.1", port, 1, timedelta(seconds=10))
    try:
        store.set("k", "v")
        assert _reaches("127.0.0.1", port) and not _reaches("127.0.0.2", port)
    finally:
        del store
    port = free_port()
    with socket.create_server(("127.0.0.1", port)):   # a squatter (no SO_REUSEPORT)
        with pytest.raises(Exception, match="(?i)address already in use|EADDRINUSE|errno 98"):
            host_store("127.0.0.1", port, 1, timedelta(seconds=5))
        assert not _reaches("127.0.0.2", port)
