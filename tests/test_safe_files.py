"""Files and directories another local user could use against a worker (issue 35,
items 3 and 4).

- A ``file://`` store is refused in a directory that anyone but this user or root
  can write or owns, all the way up (as OpenSSH checks ``~/.ssh``): a worker
  (spawn) tries ``init_rpc`` on each.
- ``distgrad demo --out DIR`` (a real process, its workers spawned) writes
  nothing through links planted in DIR: the files the links named keep their
  bytes, and each name becomes a file of the demo's. An output directory another
  user owns or can write is refused, with a message that says why.
- :mod:`distgrad.safe_files` itself: a planted link is replaced, never followed.

The cases with another user's directory need root (to chown one to ``nobody``).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mp_utils import run_workers

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534
AS_ROOT = os.geteuid() == 0


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(OMP_NUM_THREADS="1", DISTGRAD_NO_DOT="1", **extra)
    return env


def _try_stores(rank: int, world_size: int, paths: dict[str, str]) -> dict[str, str]:
    import distgrad.rpc as rpc
    out = {}
    for case, path in paths.items():
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{path}")
        try:
            rpc.init_rpc("worker0", rank=0, world_size=1, rpc_backend_options=opts)
        except Exception as e:  # noqa: BLE001 - what happened is the result
            out[case] = f"{type(e).__name__}: {e}"
            continue
        rpc.shutdown()
        out[case] = "started"
    return out


def _dir(path: Path, mode: int, owner: int | None = None) -> Path:
    path.mkdir()
    os.chmod(path, mode)
    if owner is not None:
        os.chown(path, owner, owner)
    return path


def test_a_file_store_is_refused_where_another_user_could_swap_it(tmp_path):
    paths = {"group writable": _dir(tmp_path / "group", 0o770) / "store",
             "world writable": _dir(tmp_path / "world", 0o777) / "store",
             "ours, private": _dir(tmp_path / "good", 0o700) / "store"}
    linked = _dir(tmp_path / "linked", 0o700)   # a store path hard-linked to another file
    (linked / "precious").write_bytes(b"keep")
    os.chmod(linked / "precious", 0o640)
    os.link(linked / "precious", linked / "store")
    paths["hard-linked to another file"] = linked / "store"
    if AS_ROOT:   # another user's directories (root can make them)
        paths["another user's, 0755"] = _dir(tmp_path / "theirs", 0o755, NOBODY) / "store"
        outer = _dir(tmp_path / "outer", 0o755)
        inner = _dir(outer / "inner", 0o700)
        os.chown(outer, NOBODY, NOBODY)   # they may rename our inner directory away
        paths["ours, inside another user's"] = inner / "store"
        # another user's link in a shared sticky directory, to a private one of ours:
        # its owner could point it elsewhere after the check (torch reopens the path)
        team = _dir(tmp_path / "team", 0o1777)
        (team / "run").symlink_to(_dir(tmp_path / "private", 0o700))
        os.lchown(team / "run", NOBODY, NOBODY)
        paths["through another user's link"] = team / "run" / "store"
    got = run_workers(_try_stores, world_size=1, init=False, timeout=120,
                      args=({k: str(v) for k, v in paths.items()},))[0]
    assert got.pop("ours, private") == "started"
    assert "has 2 hard links" in got.pop("hard-linked to another file")
    assert (linked / "precious").read_bytes() == b"keep"
    assert os.stat(linked / "precious").st_mode & 0o777 == 0o640   # its mode untouched
    for case, what in got.items():
        assert what.startswith("DistgradError: file:// store"), (case, what)
        assert "another user" in what or "writable by" in what, (case, what)
        if case == "through another user's link":
            assert "symbolic link of another user" in what, what
        assert not Path(paths[case]).exists(), (case, "created the store anyway")


_TARGETS = ("summary.json", "trace.json", "autograd_graph.dot", "autograd_graph.json",
            "training_curves.png", "trace.png")


def test_the_demo_writes_nothing_through_planted_links(tmp_path):
    out = _dir(tmp_path / "demo", 0o755)
    secret = _dir(tmp_path / "private", 0o700)
    victims = {}
    for name in _TARGETS:
        victim = secret / f"{name}.victim"
        victim.write_bytes(b"root-only contents of " + name.encode())
        os.chmod(victim, 0o600)
        os.symlink(victim, out / name)
        victims[name] = victim
    # (the common umask, which let every file be 0644 before issue 42)
    p = subprocess.run([sys.executable, "-m", "distgrad", "demo", "--steps", "5", "--out", str(out)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=200, umask=0o022)
    story = f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    assert p.returncode == 0, story
    for name, victim in victims.items():
        assert victim.read_bytes() == b"root-only contents of " + name.encode(), (name, story)
        assert not (out / name).is_symlink() and (out / name).stat().st_size > 0, name
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
    # issue 42, item 5: every file the demo wrote (its trace too) is this user's alone
    modes = {f: oct(os.stat(out / f).st_mode & 0o777) for f in os.listdir(out)}
    assert set(_TARGETS) <= set(modes) and set(modes.values()) == {"0o600"}, modes


@pytest.mark.parametrize("case", ["world writable", "group writable", "another user's"])
def test_the_demo_refuses_an_output_directory_others_can_write(tmp_path, case):
    if case == "another user's" and not AS_ROOT:
        pytest.skip("needs root to make a directory of another user")
    out = {"world writable": lambda: _dir(tmp_path / "o", 0o777),
           "group writable": lambda: _dir(tmp_path / "o", 0o775),
           "another user's": lambda: _dir(tmp_path / "o", 0o755, NOBODY)}[case]()
    p = subprocess.run([sys.executable, "-m", "distgrad", "demo", "--steps", "5", "--out", str(out)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert f"refusing the directory {out}" in p.stderr, p.stderr
    assert "another user could plant or swap files there" in p.stderr, p.stderr
    assert os.listdir(out) == []


def test_write_file_replaces_a_planted_link_and_leaves_nothing_on_failure(tmp_path):
    from distgrad.errors import DistgradError
    from distgrad.safe_files import new_file, out_dir, write_file
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "out.txt").symlink_to(victim)
    write_file(str(tmp_path / "out.txt"), "new")
    assert victim.read_text() == "keep" and (tmp_path / "out.txt").read_text() == "new"
    assert not (tmp_path / "out.txt").is_symlink()
    with pytest.raises(RuntimeError), new_file(str(tmp_path / "half.bin")) as f:
        f.write(b"partial")
        raise RuntimeError("the writer failed")
    assert sorted(os.listdir(tmp_path)) == ["out.txt", "victim"]
    shared = _dir(tmp_path / "shared", 0o777)
    with pytest.raises(DistgradError, match="writable by anyone"):
        write_file(str(shared / "x"), b"")
    assert out_dir(str(tmp_path / "a" / "b")) == str(tmp_path / "a" / "b")


def test_a_missing_directory_is_named_as_missing_not_as_a_danger(tmp_path):
    from distgrad.errors import DistgradError
    from distgrad.safe_files import write_file
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")   # a dangling link: its target is missing
    for path, missing in ((tmp_path / "no" / "deeper" / "x.png", tmp_path / "no"),
                          (tmp_path / "gone" / "x.png", tmp_path / "nowhere")):
        with pytest.raises(DistgradError) as e:
            write_file(str(path), b"")
        assert str(e.value) == f"writing {path}: the directory {missing} does not exist", e.value
    assert sorted(os.listdir(tmp_path)) == ["gone"]
    shared = _dir(tmp_path / "shared", 0o777)   # a missing directory under an unsafe one: the danger
    with pytest.raises(DistgradError, match="writable by anyone"):
        write_file(str(shared / "no" / "x"), b"")


def test_files_are_private_by_default_and_a_mode_asked_for_is_kept(tmp_path):
    """Issue 42, item 5: files were written 0644 less the umask, so a trace (tensor
    values, worker names, the host) was readable by every local user. Now 0600
    whatever the umask; ``mode=`` still gives another (less the umask)."""
    from distgrad.safe_files import new_file, write_file
    old = os.umask(0)   # nothing taken away: the mode is what distgrad asked for
    try:
        write_file(str(tmp_path / "a.json"), "{}")
        with new_file(str(tmp_path / "b.png")) as f:
            f.write(b"png")
        with new_file(str(tmp_path / "c.txt"), binary=False) as f:
            f.write("text")
        write_file(str(tmp_path / "shared.txt"), "x", mode=0o644)
        os.umask(0o022)
        write_file(str(tmp_path / "d.json"), b"{}")
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in tmp_path.iterdir()}
    assert modes == {"a.json": "0o600", "b.png": "0o600", "c.txt": "0o600", "d.json": "0o600",
                     "shared.txt": "0o644"}, modes


def test_resolve_dir_walks_links_as_the_kernel_does(tmp_path):
    """Links of this user are followed (the resolved directory is what torch gets),
    '..' after a link is the target's parent, and a loop is named."""
    from distgrad.safe_files import resolve_dir
    real = _dir(_dir(tmp_path / "a", 0o700) / "b", 0o700)
    (tmp_path / "to_b").symlink_to(real)
    (tmp_path / "rel").symlink_to("a/b/../b")
    assert resolve_dir(str(tmp_path / "to_b")) == (None, str(real))
    assert resolve_dir(str(tmp_path / "rel")) == (None, str(real))
    assert resolve_dir(str(tmp_path / "to_b" / "..")) == (None, str(tmp_path / "a"))
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    problem, _ = resolve_dir(str(tmp_path / "loop"))
    assert problem is not None and "too many symbolic links" in problem


@pytest.mark.skipif(not AS_ROOT, reason="needs root to make another user's link")
def test_out_dir_makes_nothing_through_another_users_link(tmp_path):
    """The second audit of issue 35: out_dir made the missing directories first, through
    another user's link, and refused only then."""
    from distgrad.errors import DistgradError
    from distgrad.safe_files import out_dir
    victim = _dir(tmp_path / "victim", 0o700)
    team = _dir(tmp_path / "team", 0o1777)
    (team / "run").symlink_to(victim)
    os.lchown(team / "run", NOBODY, NOBODY)
    with pytest.raises(DistgradError, match="symbolic link of another user"):
        out_dir(str(team / "run" / "x" / "y"))
    assert os.listdir(victim) == []
