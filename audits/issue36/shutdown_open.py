"""rpc.shutdown() on the tracer while its trace is open (a user who forgot stop(), or an
error path that shuts RPC down): does the member stop recording, does the tracer say
something, and what is left on the tracer afterwards? 2 real workers."""
import os, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run_workers


def _run(rank, world_size, where, port):
    import logging, io, torch, distgrad, distgrad.rpc as rpc
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    res = []
    if rank == 0:
        distgrad.trace.start(os.path.join(where, "t.json"))
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))
        member = rpc.rpc_sync("worker1", distgrad.trace.is_tracing)
        rpc.shutdown()
        left = distgrad.trace.is_tracing()
        try:
            distgrad.trace.stop()
            stop = "stop() worked"
        except Exception as e:  # noqa: BLE001
            stop = f"{type(e).__name__}: {str(e)[:90]}"
        from distgrad.trace import recorder, session
        res.append(f"{'FAIL' if left else 'PASS'} tracer after rpc.shutdown with a trace open: is_tracing {left}, "
                   f"session kept {'session' in session._open}, stop(): {stop}; file written: "
                   f"{os.path.exists(os.path.join(where, 't.json'))} (member was recording: {member})")
        return res
    time.sleep(1.0)
    during = distgrad.trace.is_tracing()   # the tracer is inside its (collective) shutdown: alive
    rpc.shutdown()
    after = distgrad.trace.is_tracing()
    res.append(f"{'FAIL' if after else 'PASS'} member: recording while the tracer waits in shutdown {during}; "
               f"after its own rpc.shutdown still recording: {after}")
    return res


if __name__ == "__main__":
    from mp_utils import free_port
    where = tempfile.mkdtemp(prefix="audit-sd-"); os.chmod(where, 0o700)
    out = run_workers(_run, world_size=2, timeout=90, args=(where, free_port()), init=False)
    lines = out[0] + out[1]
    print("\n".join(lines))
    print("summary:", "FAIL" if any(l.startswith("FAIL") for l in lines) else "PASS")
