"""Rank 1 exits with code 3 after the others wrote their pids; the others sleep forever."""
import os
import sys
import time

pid_dir = sys.argv[1]
rank = int(os.environ["RANK"])
with open(os.path.join(pid_dir, f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))
if rank == 1:
    ws = int(os.environ["WORLD_SIZE"])
    while len(os.listdir(pid_dir)) < ws:
        time.sleep(0.05)
    print("rank1 failing", flush=True)
    sys.exit(3)
while True:
    time.sleep(1)
