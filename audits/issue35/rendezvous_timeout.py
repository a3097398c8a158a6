"""DISTGRAD_RENDEZVOUS_TIMEOUT (distgrad/rpc/lifecycle.py rdv_timeout), third audit.
  values   what rdv_timeout makes of "3", " 3 ", "0", "-1", "abc", "5s", "nan", "inf", "1e400",
           "1e-9", "" (unset-like): bad ones refused by name, none silently infinite
  effect   a real init_rpc of worker0 in a world of 2 whose worker1 never comes:
           with "3" it fails in about 3 s (not the 60 s default), with a clear error;
           with "inf" it should either be refused or wait (checked for 8 s: no odd crash)
Run: cd <repo> && PYTHONPATH=$PWD DISTGRAD_PURE=1 python audits/issue35/rendezvous_timeout.py"""
import os, socket, subprocess, sys, time

CODE = r'''
import os, time, torch, distgrad.rpc as rpc
t0 = time.monotonic()
try:
    rpc.init_rpc("worker0", rank=0, world_size=2)
    print("RESULT joined", flush=True)
except BaseException as e:
    print(f"RESULT {time.monotonic() - t0:.1f}s {type(e).__name__}: {str(e)[:200]}", flush=True)
'''


def values():
    from distgrad.rpc.lifecycle import rdv_timeout
    import distgrad.rpc as rpc
    opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=20)
    res, bad = {}, []
    for v in ["3", " 3 ", "0", "-1", "abc", "5s", "nan", "inf", "1e400", "1e-9", ""]:
        os.environ["DISTGRAD_RENDEZVOUS_TIMEOUT"] = v
        try:
            res[v] = rdv_timeout(opts)
        except Exception as e:  # noqa: BLE001
            res[v] = f"{type(e).__name__}: {str(e)[:70]}"
    os.environ.pop("DISTGRAD_RENDEZVOUS_TIMEOUT")
    for k, v in res.items():
        print(f"values: {k!r:8} -> {v}")
    for k in ("inf", "1e400"):
        if res[k] == float("inf"):
            bad.append(f"{k!r} accepted as an infinite wait")
    for k in ("0", "-1", "abc", "5s", "nan"):
        if not isinstance(res[k], str):
            bad.append(f"{k!r} accepted")
    return bad


def effect(value, limit):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               DISTGRAD_RENDEZVOUS_TIMEOUT=value)
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True,
                           timeout=limit)
        out = [l for l in p.stdout.splitlines() if l.startswith("RESULT")]
        print(f"effect {value!r}: rc={p.returncode} {out} ({time.monotonic() - t0:.1f} s wall)")
        if not out:
            print("   stderr:", p.stderr[-400:])
        return out[0] if out else f"rc {p.returncode}"
    except subprocess.TimeoutExpired:
        print(f"effect {value!r}: still waiting after {limit} s (killed)")
        return "waiting"


if __name__ == "__main__":
    bad = values()
    r3 = effect("3", 60)
    if "RESULT" not in r3 or float(r3.split()[1][:-1]) > 15:
        bad.append(f"'3' did not fail within 15 s: {r3}")
    rinf = effect("inf", 8)
    if "Overflow" in rinf or "Error" in rinf and "inf" not in rinf:
        bad.append(f"'inf' ended oddly: {rinf}")
    for b in bad:
        print("FAIL:", b)
    print("PASS" if not bad else "FAIL")
