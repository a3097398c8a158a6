"""``distgrad --help`` answers at once: it imports neither torch nor distgrad's layers
(importing torch took about 8 s on a cold machine), and prints the same text as the
full parser. A program of the user's that happens to get ``--help`` still gets the
whole package.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(240)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _imported(cmd: list[str], cwd: Path) -> tuple[str, set[str]]:
    """Run ``cmd`` (a python command line) under ``-X importtime``; its stdout and the
    modules it imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", *cmd], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    mods = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
            if line.startswith("import time:") and "|" in line}
    assert "distgrad" in mods, "importtime recorded nothing: the check would be empty"
    return done.stdout, mods


def _torch_like(mods: set[str]) -> list[str]:
    return sorted(m for m in mods if m == "torch" or m.startswith("torch.")
                  or m.startswith("distgrad.") and m != "distgrad.cli" and m != "distgrad.__main__")


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_python_m_distgrad_help_imports_no_torch(flag, tmp_path):
    out, mods = _imported(["-m", "distgrad", flag], tmp_path)
    assert out.startswith("usage: distgrad "), out
    for command in ("demo", "launch", "build-native", "store", "trace-plot"):
        assert command in out, out
    assert _torch_like(mods) == [], _torch_like(mods)


def test_the_console_script_help_imports_no_torch(tmp_path):
    # the file pip writes for [project.scripts] distgrad = "distgrad.cli:main"
    script = tmp_path / "distgrad"
    script.write_text("import re\nimport sys\nfrom distgrad.cli import main\n"
                      "if __name__ == '__main__':\n"
                      "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
                      "    sys.exit(main())\n")
    out, mods = _imported([str(script), "--help"], tmp_path)
    assert out.startswith("usage: distgrad "), out
    assert _torch_like(mods) == [], _torch_like(mods)


def test_the_short_help_is_the_full_parsers_help():
    from distgrad.cli import build_parser
    assert build_parser(top_level_only=True).format_help() == build_parser().format_help()


def test_a_users_program_given_help_still_gets_the_whole_package(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text("import sys\nimport distgrad\n"
                    "print(sorted(m for m in ('distgrad.rpc', 'distgrad.autograd', 'torch') "
                    "if m in sys.modules), hasattr(distgrad, 'info'))\n")
    out, _ = _imported([str(prog), "--help"], tmp_path)
    assert out.strip() == "['distgrad.autograd', 'distgrad.rpc', 'torch'] True", out
    # `python -m <a module of the user's> --help` that imports distgrad: the same
    (tmp_path / "usermod.py").write_text(prog.read_text())
    out, _ = _imported(["-m", "usermod", "--help"], tmp_path)
    assert out.strip() == "['distgrad.autograd', 'distgrad.rpc', 'torch'] True", out
    # and a subcommand's help builds the full parser (launch's options are torchrun's)
    done = subprocess.run([sys.executable, "-m", "distgrad", "launch", "--help"], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--nproc-per-node" in done.stdout, done.stderr[-2000:]
