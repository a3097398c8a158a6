"""The ``distgrad`` command: ``demo`` end to end, ``launch`` through the CLI."""
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(args, timeout):
    return subprocess.run([sys.executable, "-m", "distgrad", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo-out"
    p = _run(["demo", "--steps", "30", "--out", str(out)], timeout=180)
    story = f"exit {p.returncode}\n--- stdout ---\n{p.stdout}\n--- stderr ---\n{p.stderr[-4000:]}"
    assert p.returncode == 0, story
    assert "gradient check: OK" in p.stdout, story
    assert "distributed gradients match single-process gradients on all 6 parameters" in p.stdout
    assert "== distgrad demo summary ==" in p.stdout, story
    for key in ("test accuracy", "steps/s", "sent per step", "compute", "communication"):
        assert key in p.stdout, (key, story)

    curves = out / "training_curves.png"
    assert curves.read_bytes()[:8] == PNG_MAGIC
    graph = out / "autograd_graph.svg"
    root = ET.parse(graph).getroot()
    assert root.tag.endswith("svg")
    text = graph.read_text()
    for name in ("driver", "ps", "stage1", "stage2", "SendRpcBackward", "RecvRpcBackward"):
        assert name in text, name

    s = json.loads((out / "summary.json").read_text())
    assert s["workers"] == ["driver", "ps", "stage1", "stage2"]
    assert s["steps"] == 30 and len(s["history"]["loss"]) == 30
    assert s["steps_per_second"] > 0 and s["bytes_per_step"] > 0
    # the batch alone crosses the wire several times per step (64x64 float32 = 16 KiB)
    assert s["bytes_per_step"] > 4 * 64 * 64 * 4
    assert s["history"]["loss"][-1] < s["history"]["loss"][0]
    assert 0 <= s["test_accuracy"] <= 1
    # ps->driver, driver<->stage1, driver<->stage2 (the batch sent to ps needs no gradient)
    assert s["graph"]["cross_worker_edges"] == 5


def test_demo_rejects_too_few_workers(tmp_path, capsys):
    from distgrad.cli import main
    assert main(["demo", "--workers", "2", "--out", str(tmp_path)]) == 2
    assert "--workers must be >= 3" in capsys.readouterr().err


def test_cli_help(capsys):
    from distgrad.cli import main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "demo" in out and "launch" in out
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    out = capsys.readouterr().out
    for opt in ("--workers", "--steps", "--batch-size", "--out", "--lr"):
        assert opt in out


def test_cli_launch(capfd):
    from distgrad.cli import main
    script = ROOT / "tests" / "launch_scripts" / "print_env.py"
    assert main(["launch", "--nproc-per-node", "2", str(script), "--flag"]) == 0
    lines = [ln.split("ENV ", 1)[1] for ln in capfd.readouterr().out.splitlines() if "ENV " in ln]
    assert len(lines) == 2
    assert sorted(json.loads(ln)["env"]["RANK"] for ln in lines) == ["0", "1"]
    assert all(json.loads(ln)["argv"] == ["--flag"] for ln in lines)
