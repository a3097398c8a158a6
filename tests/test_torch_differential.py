"""The same program on torch's RPC and distributed autograd and on distgrad's, each in
processes of their own (tests/torch_differential.py): every observation equal (issue 34).
The torch run imports nothing of distgrad (its workers are spawned from a plain
``python`` process that imports only tests/torch_differential.py)."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(600)
HERE = os.path.dirname(os.path.abspath(__file__))


def _run(impl: str) -> dict:
    p = subprocess.run([sys.executable, os.path.join(HERE, "torch_differential.py"), "--impl", impl],
                       capture_output=True, text=True, timeout=400, cwd=HERE)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_observations_equal_torchs():
    want, got = _run("torch"), _run("distgrad")
    assert "error" not in want, want
    assert got == want
