"""DDP inside a distributed backward on the native engine, against torch's own RPC and
distributed autograd (tests/ddp_native_differential.py): two DDPs in two threads at once
(a lock held across DDP's all-reduce deadlocked them), and a DDP parameter's hooks over
two passes in one context (its AccumulateGrad pre-hook sees only the pass's gradient)."""
import os

import pytest
from mp_utils import differential_equal

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(os.environ.get("DISTGRAD_NATIVE", "1").strip() in ("0", ""),
                       reason="DISTGRAD_NATIVE=0: the Python engine runs every pass"),
]


def test_ddp_on_the_native_engine_observes_what_torchs_does():
    differential_equal("ddp_native_differential.py")
