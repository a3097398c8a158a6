"""A span's details never raise into the user's block, and a trace's directory is
checked at start as it is at the close (the audit of issue 36)."""
import json
import os

import pytest
import torch

from distgrad.errors import DistgradError
from distgrad.trace import export, records


class _BadStr:
    def __str__(self):
        raise RuntimeError("no str")


class _BadDict(dict):
    def items(self):
        raise RuntimeError("no items")


def test_any_value_becomes_json_without_raising():
    vals = [torch.empty(3, device="meta"), torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8),
            {_BadStr(): 1}, _BadDict(a=1), [_BadStr()], _BadStr()]
    for v in vals:
        json.loads(json.dumps(records.value(v), allow_nan=False))
    json.loads(json.dumps(records.plain({_BadStr(): torch.empty(2, device="meta")}), allow_nan=False))


def test_a_directory_refused_at_the_close_is_refused_at_start(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o775)   # writable by its group: the close (safe_files) would refuse it
    with pytest.raises(DistgradError, match="group"):
        export.check_path(str(d / "trace.json"))
    os.chmod(d, 0o755)
    export.check_path(str(d / "trace.json"))
