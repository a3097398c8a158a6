"""The same program on torch's RPC and distributed autograd and on distgrad's, each in
processes of their own (tests/torch_differential.py): every observation equal (issue 34).
The torch run imports nothing of distgrad (its workers are spawned from a plain
``python`` process that imports only tests/torch_differential.py)."""

import pytest
from mp_utils import differential_equal

pytestmark = pytest.mark.timeout(600)


def test_observations_equal_torchs():
    differential_equal("torch_differential.py")
