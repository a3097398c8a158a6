"""For tests/test_launch_rdzv.py: a worker that joins, calls its peer, says READY
(a file in DIR), waits for DIR/go, calls again and shuts down.

    python rdzv_victim.py DIR
"""
import os
import sys
import time

import torch

import distgrad.rpc as rpc

d = sys.argv[1]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
rpc.init_rpc(f"worker{rank}")
peer = f"worker{(rank + 1) % world}"
assert rpc.rpc_sync(peer, torch.add, args=(torch.ones(2), rank)).tolist() == [1.0 + rank] * 2
open(os.path.join(d, f"ready{rank}.{os.environ['TORCHELASTIC_RESTART_COUNT']}"), "w").close()
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(d, "go")) and time.monotonic() < deadline:
    time.sleep(0.05)
assert rpc.rpc_sync(peer, torch.mul, args=(torch.ones(2), 3)).tolist() == [3.0, 3.0]
rpc.shutdown()
print(f"DONE rank={rank}", flush=True)
