"""Print the worker environment torchrun's agent gives and the script args as one JSON line."""
import json
import os
import sys

KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
        "DISTGRAD_SECRET", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS"]
line = "ENV " + json.dumps({"env": {k: os.environ.get(k) for k in KEYS}, "argv": sys.argv[1:]})
os.write(sys.stdout.fileno(), (line + "\n").encode())  # one write: workers may share a pipe
print("to-stderr", file=sys.stderr)
