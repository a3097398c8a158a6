"""distgrad.trace.on_signal (third audit).
  no_rpc     on_signal before init_rpc (plain process), SIGUSR1 x3: the job lives, the
             capture fails with a log line, the lock is released (each signal tries again)
  stress     same process: the main thread starts and joins threads in a loop while another
             process sends SIGUSR1 every ~1 ms for 4 s (the handler starts a thread from inside
             a signal handler): no hang (deadlock on threading's locks) within 60 s
  stress_stderr_pipe  the same with the child's stderr a pipe read only at the end (a slow
             log collector): the handler logs inside the signal handler, so handlers nest
             (each interrupted by the next signal) until RecursionError escapes into the
             main thread: the job exits (rc -10 once Python restored SIG_DFL at its exit)
  group      2 real workers: handler replaced is returned (the user's own one); a relative
             path with {pid} and {time}, then os.chdir: the file lands where it was resolved;
             a second signal during a capture is ignored; two captures in the same second
             with a {time} path: two files or one overwritten?; signal after rpc.shutdown()
Run: cd <repo> && PYTHONPATH=$PWD DISTGRAD_PURE=1 python audits/issue36/on_signal_audit.py"""
import glob, os, signal, subprocess, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run_workers, strict_load, perfetto_problems

NO_RPC = r'''
import os, signal, sys, threading, time, logging
logging.basicConfig(level=logging.WARNING, format="%(message)s")
import distgrad.trace as tr
tr.on_signal(sys.argv[1] + "/n-{pid}.json", seconds=0.05)
for _ in range(3):
    os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.3)
print("ALIVE1", flush=True)
if sys.argv[2] == "stress":
    print("READY", flush=True)
    t_end = time.monotonic() + 6
    n = 0
    while time.monotonic() < t_end:
        th = threading.Thread(target=lambda: None); th.start(); th.join(); n += 1
    print("ALIVE2", n, flush=True)
'''


def no_rpc(stress, pipe=False):
    where = tempfile.mkdtemp(prefix="audit-sig-")
    errf = open(os.path.join(where, "stderr.txt"), "w+")   # a file: the log never blocks on a pipe
    p = subprocess.Popen([sys.executable, "-c", NO_RPC, where, "stress" if stress else "-"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE if pipe else errf, text=True)
    sent = 0
    if stress:
        line = ""
        while "READY" not in line:
            line = p.stdout.readline()
            if not line:
                break
        t_end = time.monotonic() + 4
        while time.monotonic() < t_end and p.poll() is None:
            os.kill(p.pid, signal.SIGUSR1); sent += 1; time.sleep(0.001)
    try:
        out, perr = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill(); out, perr = p.communicate()
        print(f"stress: HANG after {sent} signals (killed)"); return False
    errf.seek(0); err = perr if pipe else errf.read()
    lines = [l for l in err.splitlines() if "signal" in l or "Traceback" in l]
    odd = [l for l in err.splitlines() if "Error" in l and "RuntimeError: distgrad.trace: RPC" not in l]
    if odd:
        print("   errors in its stderr:", sorted(set(odd))[:4])
    print(f"{'stress' if stress else 'no_rpc'}{' (stderr an unread pipe)' if pipe else ''}: rc={p.returncode} out={out.split()} signals sent={sent} "
          f"log lines={len(lines)} first: {lines[:1]}")
    return p.returncode == 0 and ("ALIVE2" in out if stress else "ALIVE1" in out)


def _run(rank, world_size, where):
    import torch, distgrad, distgrad.rpc as rpc
    if rank != 0:
        rpc.api._barrier(["worker0", "worker1"])
        return None
    out = {}
    mine = lambda s, f: None
    signal.signal(signal.SIGUSR1, mine)
    os.chdir(where)
    prev = distgrad.trace.on_signal("rel-{pid}-{time}.json", seconds=0.4)
    out["returned_user_handler"] = prev is mine
    os.chdir("/")
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGUSR1)        # during the capture: ignored
    for i in range(10):
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), i)); time.sleep(0.02)
    time.sleep(1.0)
    out["files_after_1"] = sorted(os.path.basename(f) for f in glob.glob(os.path.join(where, "*.json")))
    # two captures inside one second: same {time} stamp?
    while time.time() % 1 > 0.1:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.55)
    os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.8)
    out["files_after_3"] = sorted(os.path.basename(f) for f in glob.glob(os.path.join(where, "*.json")))
    out["in_root"] = glob.glob("/rel-*.json")
    rpc.api._barrier(["worker0", "worker1"])
    return out


def group():
    where = tempfile.mkdtemp(prefix="audit-sig-"); os.chmod(where, 0o700)
    r = run_workers(_run, world_size=2, timeout=180, args=(where,))[0]
    for k, v in r.items():
        print(f"group: {k}: {v}")
    ok = r["returned_user_handler"] and len(r["files_after_1"]) == 1 and not r["in_root"]
    for f in glob.glob(os.path.join(where, "*.json")):
        ok = ok and not perfetto_problems(strict_load(f))
    if len(r["files_after_3"]) < 3:
        print("group: FAIL two signals in the same second wrote one file ({time} has 1 s "
              "resolution; the second capture replaced the first)")
        ok = False
    return ok


AFTER = r'''
import os, signal, sys, time
sys.path.insert(0, sys.argv[2])
from mp_utils import run_workers
def f(rank, ws, where):
    import distgrad
    if rank == 0:
        distgrad.trace.on_signal(where + "/s.json", seconds=0.1)
    return os.getpid()
import distgrad
if __name__ == "__main__":
    pass
'''


def after_shutdown():
    code = r'''
import os, signal, sys, time, socket
import torch, distgrad, distgrad.rpc as rpc
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
rpc.init_rpc("worker0", rank=0, world_size=1)
distgrad.trace.on_signal(sys.argv[1] + "/s-{pid}.json", seconds=0.1)
os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.5)
rpc.shutdown()
os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.5)
os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.5)
print("ALIVE", sorted(os.listdir(sys.argv[1])), flush=True)
'''
    where = tempfile.mkdtemp(prefix="audit-sig-")
    p = subprocess.run([sys.executable, "-c", code, where], capture_output=True, text=True, timeout=120)
    print(f"after_shutdown: rc={p.returncode} out={p.stdout.strip()} "
          f"log: {[l[:140] for l in p.stderr.splitlines() if 'signal' in l][:3]}")
    return p.returncode == 0 and "ALIVE" in p.stdout


if __name__ == "__main__":
    parts = {"no_rpc": no_rpc(False), "stress": no_rpc(True),
             "stress_stderr_pipe (minor)": no_rpc(True, pipe=True), "after_shutdown": after_shutdown(),
             "group": group()}
    for k, v in parts.items():
        print(("PASS " if v else "FAIL ") + k)
    print("PASS" if all(parts.values()) else "FAIL")
