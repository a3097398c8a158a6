"""``DISTGRAD_SPIN_US`` (issue 27): opt-in busy polling before a thread sleeps.

Off by default (an idle worker costs no CPU); with it, calls are served as before;
a value that is not a number of microseconds in range is refused, naming the
variable.
"""
import os
import subprocess
import sys

import pytest
import torch
from mp_utils import run_workers

pytestmark = pytest.mark.timeout(120)


def test_spin_is_off_unless_asked_and_parsed_in_microseconds():
    # imported here: the workers of the last test import this module before their
    # environment (DISTGRAD_SPIN_US) is set, and must not have read it by then
    from distgrad.transport.reading import _spin_seconds
    assert _spin_seconds(None) == 0.0
    assert _spin_seconds("") == 0.0
    assert _spin_seconds("250") == pytest.approx(250e-6)
    for bad in ("abc", "-1", "1e7"):
        with pytest.raises(ValueError, match="DISTGRAD_SPIN_US"):
            _spin_seconds(bad)


def test_a_bad_spin_value_stops_the_import_with_a_clear_error():
    env = {**os.environ, "DISTGRAD_SPIN_US": "fast"}
    res = subprocess.run([sys.executable, "-c", "import distgrad"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "DISTGRAD_SPIN_US must be a number of microseconds" in res.stderr, res.stderr


def _calls(rank, world_size):
    import distgrad.rpc as rpc
    from distgrad.transport import reading
    assert reading.SPIN_S == pytest.approx(200e-6)
    if rank == 0:
        futs = [rpc.rpc_async("worker1", torch.add, args=(torch.ones(4), i)) for i in range(50)]
        outs = [rpc.rpc_sync("worker1", torch.mul, args=(torch.ones(2), i)) for i in range(50)]
        return ([f.wait().tolist() for f in futs], [o.tolist() for o in outs])
    return None


def test_calls_are_served_the_same_while_threads_spin():
    env = {"DISTGRAD_SPIN_US": "200"}
    got = run_workers(_calls, world_size=2, timeout=90, env_per_rank={0: env, 1: env})[0]
    assert got[0] == [[1.0 + i] * 4 for i in range(50)]
    assert got[1] == [[float(i)] * 2 for i in range(50)]
