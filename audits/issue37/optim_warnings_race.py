"""distgrad only (no RPC): _LocalOptimizer's twin construction wraps itself in
warnings.catch_warnings(record=True), which swaps process-global state (warnings.filters,
warnings._showwarnmsg_impl). Two owners' RPC threads building local optimizers at once
(two trainers creating a DistributedOptimizer at the same time) interleave
enter A, enter B, exit A, exit B: B's exit restores A's recording list, and from then on
every warning of the process is appended to that dead list (never shown) and the
"always" filter stays installed.
    PYTHONPATH=$PWD DISTGRAD_PURE=1 python audits/issue37/optim_warnings_race.py [natural|forced]
natural: two threads build the first twin at once (the first one imports
torch.distributed.optim, ~0.8 s, while the other waits inside its catch_warnings).
forced: the twin class is made slow so the interleaving is certain."""
from __future__ import annotations

import json
import sys
import threading
import time
import warnings

import torch

from distgrad.optim import optimizer as dgo

mode = sys.argv[1] if len(sys.argv) > 1 else "natural"
before = {"impl": warnings._showwarnmsg_impl.__qualname__, "n_filters": len(warnings.filters)}

if mode == "forced":
    import torch.distributed.optim.utils as u
    real = u.functional_optim_map[torch.optim.SGD]

    class Slow(real):
        def __init__(self, params, *a, **k):
            time.sleep(0.5 if threading.current_thread().name == "A" else 1.0)
            super().__init__(params, *a, **k)
    u.functional_optim_map[torch.optim.SGD] = Slow


def build():
    p = torch.nn.Parameter(torch.ones(2))
    dgo._functional_twin(torch.optim.SGD, [p], (), {"lr": 0.1})


a = threading.Thread(target=build, name="A")
b = threading.Thread(target=build, name="B")
a.start()
time.sleep(0.1 if mode == "forced" else 0.0)
b.start()
a.join(10)
b.join(10)

import io
buf, real_err = io.StringIO(), sys.stderr
sys.stderr = buf                       # where the default warning display writes
warnings.warn("a UserWarning after the optimizers were built", UserWarning)
sys.stderr = real_err
shown = buf.getvalue().splitlines()[:1]
after = {"impl": warnings._showwarnmsg_impl.__qualname__, "n_filters": len(warnings.filters),
         "first_filter": str(warnings.filters[0][0])}
print(json.dumps({"mode": mode, "before": before, "after": after,
                  "warning_after_shown": shown}))
