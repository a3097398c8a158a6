"""Files distgrad writes, and directories it trusts, safe from other local users.

Another user of the host may plant a link where distgrad is about to write (the
demo's ``--out /tmp/demo``, a trace, a graph), or own, or be able to write, a
directory on the way to a file, and so swap the file after distgrad checked it.
Two rules, used by everything in distgrad that writes a file or keeps one:

- :func:`check_dirs`: a directory, and every directory above it up to ``/``,
  belongs to this user or root, and no one else can write it, unless it has the
  sticky bit (``/tmp``: others may add entries there but not rename or remove
  ours). This is OpenSSH's rule for ``~/.ssh``, with the sticky exception. The
  path is walked as the kernel walks it (``lstat``, component by component):
  every symbolic link on the way belongs to this user or root, and the
  directories it leads through pass the same rule (:func:`resolve_dir`).
- :func:`write_file` / :func:`new_file`: a file is written, in a directory that
  passes :func:`check_dirs`, as a new file beside its path (``O_CREAT | O_EXCL |
  O_NOFOLLOW``: never through a link, never into a file someone else made), then
  renamed over the path: a link planted there is replaced, never followed. The
  file is private to this user by default (mode 0600): a trace holds tensor values,
  worker names and hosts, a demo's outputs the same kind of thing; whoever wants to
  share one runs ``chmod`` on it afterwards, or passes ``mode=``.

:func:`out_dir` makes an output directory (as ``mkdir -p``) and checks it.

Example::

    >>> d = out_dir("/tmp/demo")                    # refused if another user can write it
    >>> write_file(os.path.join(d, "summary.json"), '{"ok": true}')
    >>> with new_file(os.path.join(d, "loss.png")) as f:
    ...     fig.savefig(f, format="png")
"""
from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from typing import IO

from .errors import DistgradError

_MAX_LINKS = 40   # as the kernel's ELOOP limit


def _dir_check(d: str, st: os.stat_result, me: int) -> str | None:
    if not stat.S_ISDIR(st.st_mode):
        return f"{d} is not a directory"
    if st.st_uid not in (me, 0):
        return f"{d} belongs to another user (uid {st.st_uid}), who could replace what is in it"
    if st.st_mode & stat.S_ISVTX:
        return None   # others may add entries, not rename or remove ours
    if st.st_mode & stat.S_IWOTH:
        return f"{d} is writable by anyone and has no sticky bit"
    if st.st_mode & stat.S_IWGRP:
        return f"{d} is writable by its group (gid {st.st_gid}), not only by its owner"
    return None


def resolve_dir(path: str) -> tuple[str | None, str]:
    """(what makes directory ``path`` unsafe to hold this user's files, or None;
    the directory it names with every link resolved).

    Walks the path as the kernel does, one component at a time with ``lstat``:
    every directory met (above ``path``, ``path`` itself and every directory a
    link leads through) passes :func:`check_dirs`'s rule, and every symbolic link
    on the way belongs to this user or root: another user's link (one planted in
    a shared sticky directory) could be pointed elsewhere after the check. Hand
    the resolved directory, not ``path``, to whatever reopens files there later.

    Example::

        >>> resolve_dir("/tmp")
        (None, '/tmp')
    """
    me = os.geteuid()
    parts = os.path.join(os.getcwd(), path).split("/")[::-1]   # a stack: next on top
    cur, links = "/", 0
    try:
        problem = _dir_check(cur, os.lstat(cur), me)
    except OSError as e:
        return f"cannot check {cur}: {e}", cur
    while parts and problem is None:
        name = parts.pop()
        if name in ("", "."):
            continue
        if name == "..":   # the parent of where the walk is (links already resolved)
            cur = os.path.dirname(cur)
            continue
        nxt = os.path.join(cur, name)
        try:
            st = os.lstat(nxt)
        except OSError as e:
            return f"cannot check {nxt}: {e}", nxt
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (me, 0):
                return (f"{nxt} is a symbolic link of another user (uid {st.st_uid}), who could "
                        "point it elsewhere"), nxt
            links += 1
            if links > _MAX_LINKS:
                return f"too many symbolic links in {path}", nxt
            try:
                target = os.readlink(nxt)
            except OSError as e:
                return f"cannot read the link {nxt}: {e}", nxt
            if target.startswith("/"):
                cur = "/"
                problem = _dir_check(cur, os.lstat(cur), me)
            parts.extend(target.split("/")[::-1])
            continue
        problem = _dir_check(nxt, st, me)
        cur = nxt
    return problem, cur


def dir_problem(path: str) -> str | None:
    """What makes directory ``path`` (or one above it, or a link on the way)
    unsafe to hold this user's files, or None: see :func:`check_dirs` and
    :func:`resolve_dir`."""
    return resolve_dir(path)[0]


def check_dirs(path: str, what: str) -> str:
    """Raise DistgradError (``what``: the use, for the message) unless directory
    ``path`` and every directory above it belong to this user or root and nobody
    else can write them (a directory with the sticky bit excepted), and every
    link on the way is this user's or root's; returns the directory with its links
    resolved (:func:`resolve_dir`). A directory that does not exist is refused as
    that, a mistake to correct, not a danger.

    Example::

        >>> check_dirs("/tmp", "writing /tmp/x.json")
        '/tmp'
    """
    problem, real = resolve_dir(path)
    if problem is not None and not os.path.lexists(real):   # a plain mistake, not a danger
        raise DistgradError(f"{what}: the directory {real} does not exist")
    if problem is not None:
        raise DistgradError(f"{what}: refusing the directory {os.path.abspath(path)}: {problem}, "
                            "so another user could plant or swap files there. Use a directory "
                            "only you can write (e.g. mkdir -m 700 ~/distgrad-out)")
    return real


def out_dir(path: str, what: str = "output directory") -> str:
    """Make directory ``path`` (and its parents, mode 0755 less the umask) if it
    is missing, check it with :func:`check_dirs`, and return it. What exists of it is
    checked first: nothing is made through another user's link or directory."""
    cur, missing = os.path.abspath(path), []
    while not os.path.lexists(cur):   # (a dangling link exists: the check names it)
        cur, tail = os.path.split(cur)
        missing.append(tail)
    real = check_dirs(cur, what)
    if missing:
        os.makedirs(os.path.join(real, *reversed(missing)), exist_ok=True)
    check_dirs(path, what)
    return path


#: the mode of every file distgrad writes unless told otherwise: this user's alone
PRIVATE = 0o600


@contextlib.contextmanager
def new_file(path: str, mode: int = PRIVATE, binary: bool = True) -> Iterator[IO]:
    """A file object on a new file beside ``path``; when the block ends without an
    error the file takes ``path``'s place (a link there is replaced, not
    followed), else it is removed. ``mode`` (less the umask) is the file's: by
    default 0600, readable and writable by this user only (a trace holds tensor
    values, worker names and hosts); ``chmod`` it to share it.

    Example::

        >>> with new_file("/tmp/me/trace.png") as f:
        ...     fig.savefig(f, format="png")
        >>> oct(os.stat("/tmp/me/trace.png").st_mode & 0o777)
        '0o600'
    """
    parent = check_dirs(os.path.dirname(os.path.abspath(path)) or ".", f"writing {path}")
    base = os.path.basename(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | \
        getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = os.path.join(parent, f".{base}.{os.urandom(6).hex()}.tmp")
        try:
            fd = os.open(tmp, flags, 0o600)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb" if binary else "w", encoding=None if binary else "utf-8") as f:
            yield f
            f.flush()
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(f.fileno(), mode & ~umask)
        os.replace(tmp, os.path.join(parent, base))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_file(path: str, data: bytes | str, mode: int = PRIVATE) -> None:
    """Write ``data`` to ``path`` through :func:`new_file` (never through a link),
    mode 0600 unless ``mode`` says otherwise.

    Example::

        >>> write_file("/tmp/me/summary.json", '{"ok": true}')
        >>> oct(os.stat("/tmp/me/summary.json").st_mode & 0o777)
        '0o600'
    """
    with new_file(path, mode, binary=isinstance(data, bytes)) as f:
        f.write(data)
