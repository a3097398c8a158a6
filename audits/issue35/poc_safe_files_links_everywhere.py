"""PoC (second audit): safe_files.resolve_dir / check_dirs / out_dir / new_file and
rendezvous.own_store_file against symbolic links in every position, and the
legitimate paths that must still work.

Run as root (it makes users with setpriv): victim uid 4101, attacker uid 4102.
Layout under a fresh root-owned 0755 directory B:
  B/shared   root 1777 (like /tmp)      B/victim  4101 0700 (data/ inside)
  B/attacker 4102 0755 (dir/ inside)     B/rootl   root 0755 (root's links)
Links are made by root and lchown'ed to their owner.

Attacks (each must be refused): another user's absolute / relative link, a chain
through one, '..' after a link that leads through one, a loop, a root link into
another user's directory, the victim's own link into the attacker's directory,
a victim-owned dir inside an attacker's dir, and out_dir()/new_file() through an
attacker's link (nothing may be created in the victim's directory).
Legit (each must be accepted, resolved like os.path.realpath): a root link to the
victim's dir (as /var/run -> /run), relative paths, '.', '..', trailing slashes,
the victim's own link chains; own_store_file through a root link (returns a path
without links, torch's FileStore works there); new_file through it.

PASS when every attack is refused with nothing written and every legit path works.
The victim's python gets CAP_DAC_READ_SEARCH only to reach the interpreter under
/root; it bypasses no write permission and no link rule.
Run: cd /work/wt-audit35b && timeout 300 python audits/issue35/poc_safe_files_links_everywhere.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

PY = sys.executable
VICTIM, ATTACKER = 4101, 4102
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VICTIM_SCRIPT = r"""
import json, os, sys, time
from distgrad.safe_files import resolve_dir, out_dir, new_file
from distgrad.launch.rendezvous import own_store_file
cfg = json.loads(sys.argv[1])
out = {}
os.chdir(cfg["cwd"])
for p in cfg["paths"]:
    t = time.monotonic()
    prob, real = resolve_dir(p)
    out[p] = {"problem": prob, "real": real, "realpath": os.path.realpath(p),
              "s": round(time.monotonic() - t, 3)}
for p in cfg["outdirs"]:
    try:
        out_dir(p); out["outdir:" + p] = "accepted"
    except Exception as e:
        out["outdir:" + p] = "refused: " + str(e)[:120]
for p in cfg["newfiles"]:
    try:
        with new_file(p) as f:
            f.write(b"x")
        out["newfile:" + p] = "accepted"
    except Exception as e:
        out["newfile:" + p] = "refused: " + str(e)[:120]
for p in cfg["stores"]:
    try:
        r = own_store_file(p)
        import torch.distributed as dist
        s = dist.FileStore(r, 1)
        s.set("k", "v")
        out["store:" + p] = ["accepted", r, os.path.realpath(r) == r, s.get("k").decode()]
    except Exception as e:
        out["store:" + p] = ["refused", str(e)[:120]]
print("JSON" + json.dumps(out))
"""


def main():
    base = tempfile.mkdtemp(prefix="poc-sfl-")
    os.chmod(base, 0o755)
    S, V, A, R = (os.path.join(base, n) for n in ("shared", "victim", "attacker", "rootl"))
    for d, uid, mode in ((S, 0, 0o1777), (V, VICTIM, 0o700), (A, ATTACKER, 0o755), (R, 0, 0o755)):
        os.mkdir(d)
        os.chown(d, uid, uid)
        os.chmod(d, mode)
    for d, uid, mode in ((V + "/data", VICTIM, 0o700), (A + "/dir", ATTACKER, 0o755),
                         (A + "/vsub", VICTIM, 0o700)):
        os.mkdir(d)
        os.chown(d, uid, uid)
        os.chmod(d, mode)

    def link(path, target, uid):
        os.symlink(target, path)
        os.lchown(path, uid, uid)

    link(S + "/atk_abs", V, ATTACKER)
    link(S + "/atk_rel", "../victim", ATTACKER)
    link(S + "/v_chain", S + "/atk_abs", VICTIM)
    link(V + "/up", "../shared/atk_abs/data", VICTIM)
    link(V + "/loop1", "loop2", VICTIM)
    link(V + "/loop2", "loop1", VICTIM)
    link(R + "/to_atk", A + "/dir", 0)
    link(V + "/to_atk", A + "/dir", VICTIM)
    link(R + "/run", V, 0)                       # as /var/run -> /run
    link(V + "/l1", "l2", VICTIM)
    link(V + "/l2", "data/", VICTIM)
    link(V + "/dot", ".", VICTIM)
    link(S + "/v_own", V, VICTIM)                # the victim's own link in a sticky dir
    attacks = [S + "/atk_abs", S + "/atk_rel", S + "/v_chain", V + "/up", V + "/up/..",
               V + "/loop1", R + "/to_atk", V + "/to_atk", A + "/vsub", S + "/atk_abs/data",
               S + "/atk_abs/..", "../shared/atk_rel/data"]
    legit = [R + "/run", R + "/run/data", R + "/run/data/", "data", "./data", "data/", ".", "..",
             "../victim//data/", "data/../data", "l1", "l1/", "dot/dot/data", S, S + "/",
             S + "/v_own/data", R + "/run/l1/../data", "/"]
    cfg = {"cwd": V, "paths": attacks + legit,
           "outdirs": [S + "/atk_abs/newdir_by_outdir", R + "/run/legit_out/sub"],
           "newfiles": [S + "/atk_abs/planted.txt", R + "/run/legit.txt", "data/rel.txt"],
           "stores": [S + "/atk_abs/store", R + "/run/store", S + "/v_own/store2"]}
    cmd = ["setpriv", f"--reuid={VICTIM}", f"--regid={VICTIM}", "--clear-groups",
           "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
           PY, "-c", VICTIM_SCRIPT, json.dumps(cfg)]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": REPO, "DISTGRAD_PURE": "1",
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    line = [l for l in r.stdout.splitlines() if l.startswith("JSON")]
    if not line:
        print("FAIL (harness)", r.stdout[-2000:], r.stderr[-3000:])
        return 2
    res = json.loads(line[0][4:])
    bad = []
    for p in attacks:
        x = res[p]
        ok = x["problem"] is not None and x["s"] < 2
        print(f"  attack {p.replace(base, 'B')}: {'refused' if x['problem'] else 'ACCEPTED'} "
              f"({(x['problem'] or x['real'])[:90].replace(base, 'B')}) -> {'holds' if ok else 'FAIL'}")
        if not ok:
            bad.append(p)
    for p in legit:
        x = res[p]
        ok = x["problem"] is None and x["real"].rstrip("/") == x["realpath"].rstrip("/") \
            or (x["real"] == "/" == x["realpath"])
        print(f"  legit {p.replace(base, 'B')}: {'accepted ' + x['real'].replace(base, 'B') if x['problem'] is None else 'REFUSED ' + x['problem'].replace(base, 'B')[:90]}"
              f" -> {'holds' if ok else 'FAIL'}")
        if not ok:
            bad.append(p)
    made = os.path.exists(V + "/newdir_by_outdir")
    k = "outdir:" + S + "/atk_abs/newdir_by_outdir"
    print(f"  attack out_dir(B/shared/atk_abs/newdir_by_outdir): {res[k][:60].replace(base, 'B')}; "
          f"directory created in the victim's dir: {made} -> "
          f"{'FAIL (makedirs ran through the attacker link before the check)' if made else 'holds'}")
    if made or res[k] == "accepted":
        bad.append(k)
    k = "outdir:" + R + "/run/legit_out/sub"
    print(f"  legit out_dir(B/rootl/run/legit_out/sub): {res[k][:60]} -> "
          f"{'holds' if res[k] == 'accepted' else 'FAIL'}")
    if res[k] != "accepted":
        bad.append(k)
    planted = os.path.exists(V + "/planted.txt")
    k = "newfile:" + S + "/atk_abs/planted.txt"
    print(f"  attack new_file through attacker link: {res[k][:50]}, written: {planted} -> "
          f"{'FAIL' if planted or res[k] == 'accepted' else 'holds'}")
    if planted or res[k] == "accepted":
        bad.append(k)
    for k in ("newfile:" + R + "/run/legit.txt", "newfile:data/rel.txt"):
        print(f"  legit {k.replace(base, 'B')}: {res[k][:60]} -> {'holds' if res[k] == 'accepted' else 'FAIL'}")
        if res[k] != "accepted":
            bad.append(k)
    k = "store:" + S + "/atk_abs/store"
    ok = res[k][0] == "refused" and not os.path.exists(V + "/store")
    print(f"  attack store through attacker link: {res[k][0]} -> {'holds' if ok else 'FAIL'}")
    if not ok:
        bad.append(k)
    for k in ("store:" + R + "/run/store", "store:" + S + "/v_own/store2"):
        x = res[k]
        ok = x[0] == "accepted" and x[2] and x[3] == "v"
        print(f"  legit {k.replace(base, 'B')}: {str(x).replace(base, 'B')[:120]} -> {'holds' if ok else 'FAIL'}")
        if not ok:
            bad.append(k)
    print("FAIL: " + ", ".join(b.replace(base, "B") for b in bad) if bad else "PASS")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
