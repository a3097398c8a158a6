"""torch's own DDP-under-distributed-autograd and RemoteModule test classes, and the
shape of the DDP-with-RPC tutorial, run with distgrad swapped in for
``torch.distributed.rpc``/``.autograd`` by module patching (``tests/torch_swap.py``).

* ``DdpUnderDistAutogradTest`` and ``DdpComparisonTest``
  (``torch.testing._internal.distributed.ddp_under_dist_autograd_test``),
  ``RemoteModuleTest`` and ``ThreeWorkersRemoteModuleTest``
  (``torch.testing._internal.distributed.nn.api.remote_module_test``): built by
  ``tests/torch_suites.py`` and run by ``python -m pytest`` in a subprocess (each
  test spawns its 2 to 6 workers there), in one run; each test here reports one
  of them. The suite runs :data:`SAMPLE` (45 s on 2 cores, 70 s beside other
  work); with ``DISTGRAD_TORCH_SUITES_FULL=1`` all 24 tests of the four classes
  (140 s, 4-5 min beside other work; torch's own take 3-16 s each).
* ``tests/ddp_rpc_program.py``: the tutorial's program shape, written for
  torch's names, run unchanged with the swap made by a ``sitecustomize`` in
  every one of its processes.

Under this swap every DDP pass hung until the flush (``autograd/ddp.py``) took
torch's own distributed autograd from ``torch._C`` instead of the name
``torch.distributed.autograd``, which had become distgrad's.
"""
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from mp_utils import SLOW, free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

SAMPLE = [
    # DDP inside the hybrid model; the master builds each trainer's model (dist.new_group
    # there) over RPC right after init_process_group (rpc/c10d_order.py)
    "DdpUnderDistAutogradTest::test_backward_ddp_inside",
    # DDP after a RemoteModule; remote gradients compared over RPC
    "DdpComparisonTest::test_ddp_dist_autograd_local_vs_remote",
    # DDP and join() over uneven inputs, distributed against local autograd
    "DdpComparisonTest::test_ddp_comparison_uneven_inputs",
    # both kinds of RemoteModule, the scripted one included (nn/scriptable.py)
    "RemoteModuleTest::test_forward_sync",
    "ThreeWorkersRemoteModuleTest::test_send_remote_module_over_the_wire_script_not_supported",
]
ALL = {
    "DdpUnderDistAutogradTest": ["test_backward_no_ddp", "test_backward_ddp_outside",
                                 "test_backward_ddp_outside_uneven_inputs", "test_backward_ddp_inside"],
    "DdpComparisonTest": ["test_ddp_comparison", "test_ddp_comparison_uneven_inputs",
                          "test_ddp_dist_autograd_sparse_grads", "test_ddp_dist_autograd_local_vs_remote"],
    "RemoteModuleTest": ["test_bad_module", "test_forward_async", "test_forward_async_script",
                         "test_forward_sync", "test_forward_sync_script", "test_forward_with_kwargs",
                         "test_remote_parameters", "test_get_module_rref", "test_train_eval",
                         "test_unsupported_methods",
                         "test_send_remote_module_with_a_new_attribute_not_pickled_over_the_wire",
                         "test_remote_module_py_pickle_not_supported",
                         "test_remote_module_py_pickle_not_supported_script"],
    "ThreeWorkersRemoteModuleTest": ["test_send_remote_module_over_the_wire",
                                     "test_send_remote_module_over_the_wire_script_not_supported",
                                     "test_create_remote_module_from_module_rref"],
}
FULL = os.environ.get("DISTGRAD_TORCH_SUITES_FULL") == "1"
SELECTED = [f"{c}::{t}" for c, ts in ALL.items() for t in ts] if FULL else SAMPLE
PER_TEST = int(60 * SLOW)   # torch's own runs take 8-16 s each on 2 cores


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def suite_results(tmp_path_factory):
    """Run the selected tests in one subprocess; ``{"Class::test": (outcome, seconds, text)}``."""
    junit = tmp_path_factory.mktemp("torch_suites") / "junit.xml"
    classes = sorted({s.split("::")[0] for s in SELECTED})
    ids = [f"tests/torch_suites.py::Distgrad{s}" for s in SELECTED]
    cmd = [sys.executable, "-m", "pytest", *ids, "-p", "no:cacheprovider", "-q", "-rfE",
           "-W", "ignore::DeprecationWarning", f"--junitxml={junit}", f"--timeout={PER_TEST + 60}"]
    env = _env(DISTGRAD_TORCH_SUITES=",".join(classes), DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(PER_TEST))
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=len(SELECTED) * (PER_TEST + 30) + 120)
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        log = f"timed out\n{e.stdout or ''}{e.stderr or ''}"
    print(f"{len(SELECTED)} torch tests in {time.monotonic() - t0:.0f} s")
    results = {}
    if junit.exists():
        for tc in ET.parse(junit).getroot().iter("testcase"):
            cls = tc.get("classname", "").rsplit(".", 1)[-1].removeprefix("Distgrad")
            outcome, text = "passed", ""
            for child in tc:
                if child.tag in ("failure", "error", "skipped"):
                    outcome, text = child.tag, (child.text or child.get("message", ""))
            results[f"{cls}::{tc.get('name')}"] = (outcome, float(tc.get("time") or 0), text)
    for name, (outcome, seconds, _) in sorted(results.items()):
        print(f"  {name}: {outcome}, {seconds:.1f} s")
    return results, log[-6000:]


@pytest.mark.timeout(len(SELECTED) * (PER_TEST + 30) + 300)
@pytest.mark.parametrize("test", SELECTED)
def test_torch_suite(suite_results, test):
    results, log = suite_results
    assert test in results, f"{test} did not run:\n{log}"
    outcome, seconds, text = results[test]
    assert outcome == "passed", f"{test}: {outcome} after {seconds:.1f} s\n{text[-6000:]}"


@pytest.mark.timeout(int(120 * SLOW) + 60)
def test_ddp_rpc_tutorial_shape():
    """The tutorial's program shape under the swap: it ends, the DDP replicas agree,
    the remote table and the DDP layer trained."""
    with tempfile.TemporaryDirectory() as site:
        # the swap in every process of the program, spawned workers included
        Path(site, "sitecustomize.py").write_text("import torch_swap\n\ntorch_swap.install()\n")
        env = _env(RPC_PORT=str(free_port()), PG_PORT=str(free_port()))
        env["PYTHONPATH"] = os.pathsep.join([site, env["PYTHONPATH"]])
        proc = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning",
                               str(HERE / "ddp_rpc_program.py"), "2"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=int(120 * SLOW))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ddp_rpc ok" in proc.stdout, out[-6000:]
    assert "rpc is distgrad.rpc" in proc.stdout, out[-6000:]  # the swap was in place
