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
    want = _run("torch")
    if "hung" in want:
        # torch's own run is the reference; it hung once in a full suite run (a
        # rendezvous that never met, not reproduced in dozens of runs): run it again.
        # distgrad's run gets no second chance.
        print(f"torch's reference run: {want['error']}; run again")
        want = _run("torch")
    got = _run("distgrad")
    assert "error" not in want, want
    assert got == want
