"""The ``distgrad`` command: ``demo`` end to end, ``launch`` through the CLI."""
import io
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def _run(args, timeout, **env):
    return subprocess.run([sys.executable, "-m", "distgrad", *args], cwd=ROOT, env=_env(**env),
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_demo_end_to_end(tmp_path):
    # as on a machine without Graphviz (the pip-only set-up); dot is tested in test_graph_export
    out = tmp_path / "demo-out"
    p = _run(["demo", "--steps", "30", "--out", str(out)], timeout=180, DISTGRAD_NO_DOT="1")
    story = f"exit {p.returncode}\n--- stdout ---\n{p.stdout}\n--- stderr ---\n{p.stderr[-4000:]}"
    assert p.returncode == 0, story
    assert "gradient check: OK" in p.stdout, story
    assert "distributed gradients match single-process gradients on all 6 parameters" in p.stdout
    assert "== distgrad demo summary ==" in p.stdout, story
    for key in ("test accuracy", "steps/s", "sent per step", "compute", "communication"):
        assert key in p.stdout, (key, story)
    # piped output: plain progress lines, no tqdm bar redrawn with carriage returns
    assert "\r" not in p.stdout and "\r" not in p.stderr, story
    progress = [ln for ln in p.stdout.splitlines() if ln.startswith("training: ")]
    assert 3 <= len(progress) <= 11, story
    assert progress[-1].startswith("training: 30/30 (100%)"), story
    # the summary names every file it wrote and what it shows, one line each
    listed = p.stdout.split("files written:", 1)[1].splitlines()[1:]
    for name in ("training_curves.png", "autograd_graph.png", "autograd_graph.svg", "autograd_graph.dot",
                 "autograd_graph.json", "summary.json", "trace.png", "trace.json"):
        line = next((ln for ln in listed if f"{out}{os.sep}{name} " in ln), None)
        assert line is not None and (out / name).exists(), (name, story)
        assert len(line.split(name, 1)[1].strip()) > 20, line      # says what the file shows
    assert "drawn by matplotlib" in p.stdout, story
    # one traced step: the JSON (and how to open it), its picture
    assert "open it at https://ui.perfetto.dev (or chrome://tracing)" in p.stdout, story
    assert (out / "trace.png").read_bytes()[:8] == PNG_MAGIC
    trace = json.loads((out / "trace.json").read_text())
    workers = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert len(workers) >= 3 and trace["otherData"]["distgrad"]["missing"] == {}, workers
    assert any(e["ph"] == "X" and "backward" in e["name"] for e in trace["traceEvents"])

    curves = out / "training_curves.png"
    assert curves.read_bytes()[:8] == PNG_MAGIC
    assert (out / "autograd_graph.png").read_bytes()[:8] == PNG_MAGIC
    graph = out / "autograd_graph.svg"
    root = ET.parse(graph).getroot()
    assert root.tag.endswith("svg")
    text = graph.read_text()
    for name in ("driver", "ps", "stage1", "stage2", "SendRpcBackward", "RecvRpcBackward"):
        assert name in text, name
    assert (out / "autograd_graph.dot").read_text().startswith("digraph")

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
    assert s["graph"]["engine"] == "matplotlib"


def test_demo_without_its_packages_says_what_to_install(tmp_path, capsys, monkeypatch):
    from distgrad.cli import main
    monkeypatch.setitem(sys.modules, "sklearn", None)     # as if scikit-learn were not installed
    assert main(["demo", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "scikit-learn" in err and "pip install 'distgrad[demo]'" in err and "'.[demo]'" in err
    assert "matplotlib" not in err.split("Install")[0]     # only what is missing is named
    assert not (tmp_path / "out").exists()                 # nothing started


def _count_to_500(stream=None):
    from distgrad.demo.progress import progress
    bar = progress(range(500), desc="training", stream=stream)
    for i in bar:
        bar.set_postfix(loss=f"{1 / (i + 1):.3f}")
    bar.close()
    return bar


def test_progress_piped_is_plain_lines(capsys):
    r, w = os.pipe()           # stderr as a pipe: not a terminal
    with os.fdopen(r, "rb"), os.fdopen(w, "w") as wf:
        bar = _count_to_500(stream=wf)
    out, err = capsys.readouterr()
    assert "\r" not in out + err and bar.lines == 10
    lines = out.splitlines()
    assert len(lines) == 10, out                          # one per 10%
    assert lines[0].startswith("training: 50/500 (10%)") and "loss=0.020" in lines[0]
    assert lines[-1].startswith("training: 500/500 (100%)") and "loss=0.002" in lines[-1]


def test_progress_plain_lines_every_n_seconds():
    from distgrad.demo.progress import PlainProgress
    out = io.StringIO()
    bar = PlainProgress(iter(range(5)), "work", out=out, every_s=0.0)     # no total: time only
    assert list(bar) == [0, 1, 2, 3, 4]
    bar.close()
    assert out.getvalue().splitlines()[-1].startswith("work: 5 ")
    assert bar.lines == 5


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal (POSIX)")
def test_progress_on_a_terminal_is_a_bar(capsys):
    import fcntl
    import struct
    import termios
    import threading
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    chunks = []

    def read():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:       # EIO once the terminal's other side is closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    with os.fdopen(slave, "w") as term:
        _count_to_500(stream=term)
    reader.join(10)
    os.close(master)
    bar = b"".join(chunks).decode(errors="replace")
    assert "\r" in bar and "500/500" in bar and "100%" in bar, bar[-500:]
    assert capsys.readouterr().out == ""                  # no plain lines on a terminal
