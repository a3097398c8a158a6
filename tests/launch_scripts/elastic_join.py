"""For tests/test_launch_rdzv.py: under --nnodes 1:2, a group of one node starts RPC and waits
(up to 90 s) for the agent to restart it when a second node joins; the group of
two runs an RPC each way and shuts down.

    python elastic_join.py DIR
"""
import os
import sys
import time

import torch

import distgrad.rpc as rpc

d = sys.argv[1]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"START rank={rank} world={world} attempt={attempt} "
      f"group={os.environ['GROUP_RANK']}/{os.environ['GROUP_WORLD_SIZE']}", flush=True)
open(os.path.join(d, f"started.w{world}.r{rank}"), "w").close()
rpc.init_rpc(f"worker{rank}")   # a group of one too, as every real script does
if world == 1:
    time.sleep(90)   # the agent restarts this group when the second node arrives
    sys.exit(3)
peer = f"worker{1 - rank}"
assert rpc.rpc_sync(peer, torch.add, args=(torch.ones(2), rank)).tolist() == [1.0 + rank] * 2
rpc.shutdown()
print(f"DONE rank={rank} world={world}", flush=True)
