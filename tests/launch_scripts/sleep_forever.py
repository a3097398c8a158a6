"""Write this process's pid (and a grandchild's) to a dir, then sleep forever.

With a second argument ``ignore-term`` the worker ignores SIGTERM.
"""
import os
import signal
import subprocess
import sys
import time

pid_dir = sys.argv[1]
if sys.argv[2:] == ["ignore-term"]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
rank = os.environ["RANK"]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
with open(os.path.join(pid_dir, f"pid{rank}.tmp"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.replace(os.path.join(pid_dir, f"pid{rank}.tmp"), os.path.join(pid_dir, f"pid{rank}"))
print("ready", flush=True)
while True:
    time.sleep(1)
