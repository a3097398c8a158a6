"""Random programs with devices (tests/random_devices.py, issue 44): leaves and stages on
two devices of the accelerator under test and the CPU, moved inside a worker and carried
over RPC through device maps both ways (devices and the CPU mixed in one call, replies on
devices, stages on streams of their own), against local autograd of the same computation
on the CPU in a process that never imported distgrad, with the stream-order checker on."""
import os

import pytest
import random_devices
import torch
from mp_utils import free_port, run_workers

pytestmark = pytest.mark.timeout(600)
SEEDS = range(int(os.environ.get("DISTGRAD_DEVICE_PROGRAMS", "20")))


def test_random_device_programs_match_local_autograd():
    from test_device_maps import _skip_without_devices
    _skip_without_devices()
    import clean_ref
    progs = [random_devices.generate(s) for s in SEEDS]
    want = [clean_ref.shared().call(random_devices.run_local, p) for p in progs]
    res = run_workers(random_devices.run_programs, world_size=2, timeout=500, init=False,
                      args=(free_port(), progs))
    res = [clean_ref.unpack(r) for r in res]
    assert [v for _, v in res] == [[], []]
    for prog, got, w in zip(progs, res[0][0], want):
        assert isinstance(got, dict), (prog, got)
        assert set(got) == set(w), (prog, set(got), set(w))
        for name, (g, where, leaf_at) in got.items():
            assert where == leaf_at, (prog, name, where, leaf_at)
            assert torch.allclose(g, w[name], rtol=1e-10, atol=1e-12), (prog, name, g, w[name])
