"""The smallest repro of the crash in audit/profile_ops.py stage 3, one process, no RPC:
distgrad's OpsProfiler (what profile_ops starts on each worker) while a user's scheduled
torch.profiler is in its wait phase. Expect rc 139 (SIGSEGV) at the stop on torch 2.13."""
import torch, sys
from torch.profiler import profile, schedule
from distgrad.trace.ops import OpsProfiler, active_profiler
prof = profile(schedule=schedule(wait=1, warmup=1, active=2, repeat=1))
prof.start()
print("wait phase: active_profiler() ->", active_profiler(), flush=True)
o = OpsProfiler(); o.start()
print("distgrad's profiler started", flush=True)
for i in range(4):
    torch.mm(torch.ones(4, 4), torch.ones(4, 4))
    prof.step()
    print("user step", i, flush=True)
ev, meta = o.stop()
print("distgrad ops", meta, flush=True)
prof.stop()
print("done", flush=True)
