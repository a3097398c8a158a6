"""Print the torchrun-style environment and script args as one JSON line."""
import json
import os
import sys

KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
        "DISTGRAD_SECRET", "PYTHONUNBUFFERED"]
print("ENV " + json.dumps({"env": {k: os.environ.get(k) for k in KEYS}, "argv": sys.argv[1:]}))
print("to-stderr", file=sys.stderr)
