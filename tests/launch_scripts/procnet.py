"""The TCP sockets a process tree listens on, read from /proc (Linux): for
tests/test_launch_rdzv.py and its stranger (tests/launch_scripts/stranger.py),
which imports nothing of distgrad."""
import os
from pathlib import Path


def listening(pids) -> set[str]:
    """The local addresses (``ip:port``, hex as /proc/net/tcp* shows them) that the
    processes ``pids`` and their descendants listen on."""
    inodes, todo = set(), list(pids)
    while todo:
        p = todo.pop()
        try:
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
            for fd in os.listdir(f"/proc/{p}/fd"):
                link = os.readlink(f"/proc/{p}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            pass
    out = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(name).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:
                out.add(cols[1])
    return out
