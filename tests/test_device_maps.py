"""Device maps (issue 44): torch's TensorPipe device-map scenarios on the device under
test (``distgrad.testing.accel.device_under_test()``: ``dgtest`` here, ``cuda`` with
``DISTGRAD_TEST_DEVICE=cuda`` on a GPU machine), with dgtest's stream-order checker on
throughout.

Each scenario mirrors one of torch's ``TensorPipeAgentCudaRpcTest`` tests
(torch/testing/_internal/distributed/rpc/rpc_test.py), named in its comment:
options and their start-up validation, calls and replies through a map and its
reverse, CPU <-> device maps, mixed CPU and device tensors, maps to oneself, a
missing map refused at the caller (requests) or the callee (replies), ``remote`` +
``to_here``, RRef proxies, ``async_execution``, ``then`` chains, user streams on the
callee, ``Future(devices=)`` itself, and RemoteModule on a device.

Every worker is a spawned process that loads the device first (dgtest must be loaded
before the process's first backward); pytest's own process never loads it. Each
group is one pair of workers running its scenarios in turn, so the group's cost is
two process starts and one ``init_rpc`` per scenario group.
"""
from __future__ import annotations

import re

import pytest
import torch
from mp_utils import free_port, run_workers

import distgrad.rpc as rpc

pytestmark = pytest.mark.timeout(400)


# ---------------------------------------------------------------- the device under test

def _device() -> str:
    """Load the device under test in this worker (before anything else runs here)."""
    from distgrad.testing import accel
    dev = accel.device_under_test()
    if dev != "cuda":
        assert accel.checker_enabled()
    return dev


def _skip_without_devices() -> None:
    """In pytest's own process (which never loads dgtest): skip where the device under
    test cannot run these tests (a GPU machine with one GPU; no compiler for dgtest)."""
    import os
    import shutil
    want = os.environ.get("DISTGRAD_TEST_DEVICE", "").strip().lower()
    if want == "cuda" or (want in ("", "auto") and torch.cuda.is_available()):
        if torch.cuda.device_count() < 2:
            pytest.skip("device map tests need 2 CUDA devices")
    elif not (shutil.which("g++") or shutil.which("c++")) or not shutil.which("ninja"):
        from distgrad.testing import accel
        if not accel.built():
            pytest.skip("dgtest cannot be built here (no C++ compiler or ninja)")


def _violations() -> list:
    """The stream-order checker's violations in this worker (none on cuda: no checker)."""
    from distgrad.testing import accel
    if accel.device_under_test() == "cuda":
        return []
    accel.check()
    return accel.violations()


def _mod(dev: str):
    return torch.get_device_module(dev)


def _busy(device: torch.device) -> None:
    """Keep the current stream busy for a while on a real GPU (nothing on dgtest: there
    the checker finds a missing synchronization without any race)."""
    if device.type == "cuda":
        torch.cuda._sleep(50_000_000)


def _opts(port: int, **kw) -> rpc.TensorPipeRpcBackendOptions:
    return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", **kw)


def _init(rank: int, world: int, opts) -> None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)


# ---------------------------------------------------------------- functions the callee runs

def _gpu_add(x, y):
    """torch's ``_gpu_add``: both arguments must arrive on device 1."""
    if all([x.device.type != "cpu", x.device.index == 1, y.device.type != "cpu", y.device.index == 1]):
        return (x + y).to(0)
    raise ValueError("Wrong device affinity")


def _gpu_add_given_devices(x, y, x_to, y_to, z_to):
    """torch's ``_gpu_add_given_devices`` (``"cpu"`` or a device index)."""
    x_device = "cpu" if x.device.type == "cpu" else x.device.index
    y_device = "cpu" if y.device.type == "cpu" else y.device.index
    if x_device == x_to and y_device == y_to:
        return x.to(z_to) + y.to(z_to)
    raise ValueError("Wrong device affinity")


def _gpu_add_multi_gpu(x, y):
    """torch's ``_gpu_add_multi_gpu``: x on device 1, y on device 0."""
    if all([x.device.type != "cpu", x.device.index == 1, y.device.type != "cpu", y.device.index == 0]):
        return x.to(0) + y, x - y.to(1)
    raise ValueError("Wrong device affinity")


def _add_to_gpu(x, y):
    """torch's ``_add_to_gpu``."""
    return (x + y).to(0)


def _add_to(x, y, index):
    return (x + y).to(index)


def _where(*values):
    """The devices the arguments arrived on, and their flags."""
    return [(str(v.device), v.requires_grad, type(v).__name__, v.is_contiguous())
            if isinstance(v, torch.Tensor) else None for v in values]


def _layouts(*values):
    """Each argument's strides and its storage's bytes, as it arrived."""
    return [(tuple(v.stride()), v.untyped_storage().nbytes()) for v in values]


def _echo(*values):
    return values


def _slow_add_on_user_stream(x, y):
    """torch's ``_slow_add_on_user_stream``, on any accelerator."""
    mod = _mod(x.device.type)
    s0 = mod.current_stream(x.device)
    s1 = mod.Stream(x.device)
    s1.wait_stream(s0)
    x.record_stream(s1)
    y.record_stream(s1)
    with mod.stream(s1):
        _busy(x.device)
        z = x + y
    s0.wait_stream(s1)
    z.record_stream(s0)
    return z


@rpc.functions.async_execution
def _async_set_to_one(t):
    """torch's ``async_cuda_sleep_and_set_to_one``: the value is set on a stream of its
    own and handed back in a Future(devices=) that orders its readers after it."""
    device = t.device
    mod = _mod(device.type)
    original = mod.current_stream(device)
    new = mod.Stream(device)
    new.wait_stream(original)
    with mod.stream(new):
        _busy(device)
        t.fill_(1)
        fut = torch.futures.Future(devices=[device])
        fut.set_result(t)
        return fut


_CALLS = {"n": 0}


def _count_call(*args):
    _CALLS["n"] += 1


def _calls():
    return _CALLS["n"]


class _Holder:
    """A value on the owner's device (RRef proxies)."""

    def __init__(self, device):
        self.t = torch.arange(4.0, device=device)

    def add(self, x):
        return self.t + x

    def where(self):
        return str(self.t.device)


def _own_rref(device):
    return rpc.RRef(torch.ones(2, device=device))


def _rref_value_device(rref):
    v = rref.to_here()
    return str(v.device), v.tolist()


class _Affine(torch.nn.Module):
    """A module with known weights: y = 2 * x.sum(-1, keepdim) + 1 per output."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(n_in, n_out)
        with torch.no_grad():
            self.lin.weight.fill_(2.0)
            self.lin.bias.fill_(1.0)

    def forward(self, x):
        return self.lin(x)


def _fill_on_side_stream(mod, t, fut) -> None:
    """Fill ``t`` with ones on a new stream of its device and complete ``fut`` with it there."""
    with mod.device(t.device.index):
        with mod.stream(mod.Stream(t.device)):
            _busy(t.device)
            t.fill_(1)
            fut.set_result(t)


def _expect_init_error(rank, world, opts, match, kind=ValueError) -> str:
    with pytest.raises(kind, match=match) as ei:
        _init(rank, world, opts)
    assert not rpc.api._is_current_rpc_agent_set()
    rpc.shutdown()  # after a failed init: returns quietly
    return str(ei.value).splitlines()[0]


# ---------------------------------------------------------------- group 1: options, start-up checks,
# ---------------------------------------------------------------- Future(devices=) on its own

def _options_and_futures(rank, world, ports):
    dev = _device()
    mod = _mod(dev)
    count = mod.device_count()
    d0, d1 = torch.device(dev, 0), torch.device(dev, 1)
    dst = f"worker{(rank + 1) % world}"
    out = []

    # options on their own (no agent): torch's checks and texts
    opts = _opts(ports[0])
    opts.set_device_map(dst, {0: 1})                      # test_device_maps_one_to_many
    with pytest.raises(ValueError, match="`set_device_map` only supports 1-to-1 mapping"):
        opts.set_device_map(dst, {0: 0})
    with pytest.raises(RuntimeError, match="Device index must not be negative"):
        opts.set_device_map(dst, {-1: 0})                 # test_device_maps_invalid_min_device
    with pytest.raises(RuntimeError, match="Device index must not be negative"):
        opts.set_device_map(dst, {0: -1})
    with pytest.raises(ValueError, match="`device_map` only supports 1-to-1 mapping, trying to map"):
        _opts(ports[0], device_maps={dst: {0: 0, 1: 0}})
    with pytest.raises(ValueError, match="`set_devices` expect a list of CUDA devices, but got device "
                                         "type cpu."):
        _opts(ports[0], devices=["cpu"])
    opts.set_device_map(dst, {f"{dev}:1": torch.device(dev, 0)})   # int, str, torch.device alike
    assert opts.device_maps == {dst: {d0: d1, d1: d0}}
    opts.set_devices([1, f"{dev}:0"])
    assert opts.devices == [d1, d0]

    # torch's start-up checks (every worker sees every worker's maps), torch's messages
    o = _opts(ports[1])
    o.set_device_map("none_exist", {0: 1})                # test_device_maps_wrong_worker_name
    out.append(_expect_init_error(rank, world, o, "Node worker0 has invalid target node names in "
                                                  "its device maps"))
    o = _opts(ports[2])
    o.set_device_map(dst, {count: 0})                     # test_device_maps_invalid_max_local_device
    out.append(_expect_init_error(rank, world, o, "Node worker0 has source devices with invalid "
                                                  "indices in its device map for worker1"))
    o = _opts(ports[3])
    o.set_device_map(dst, {0: count})                     # test_device_maps_invalid_max_remote_device
    out.append(_expect_init_error(rank, world, o, "Node worker0 has target devices with invalid "
                                                  "indices in its device map for worker1"))
    o = _opts(ports[4])
    o.set_device_map(dst, {1: 0})                         # test_device_maps_many_to_one
    o.set_device_map(dst, {0: 0})
    out.append(_expect_init_error(rank, world, o, "Node worker0 has duplicated target devices in its "
                                                  "device map for worker1"))
    o = _opts(ports[5])
    o.set_device_map(dst, {0: 0})                         # test_devices_option_mismatch
    o.set_devices([1])
    out.append(_expect_init_error(rank, world, o, "Node worker0 has unexpected source devices in its "
                                                  "device map for worker1"))
    o = _opts(ports[6], device_maps={dst: {0: 1}}, devices=[0])  # test_devices_option_mismatch_reverse
    out.append(_expect_init_error(rank, world, o, "Node worker0 has unexpected target devices in its "
                                                  "device map for worker1"))

    # the agent's devices default to its maps' sources and its peers' maps' targets
    _init(rank, world, _opts(ports[7], device_maps={dst: {0: 1}} if rank == 0 else {}))
    agent = rpc.api._get_current_rpc_agent()
    out.append([str(d) for d in agent.devices])
    rpc.shutdown()

    # Future(devices=): torch's test_cuda_future_* on the device under test
    torch.futures.Future(devices=[0])
    torch.futures.Future(devices=[f"{dev}:0"])
    torch.futures.Future(devices=[d0])
    with pytest.raises(ValueError, match="Expected devices to have indices, got cpu"):
        torch.futures.Future(devices=["cpu"])

    # test_cuda_future_callback_changes_devices: written on a side stream of device 0,
    # read by a callback that copies to device 1, waited on another stream of device 1
    tensor0 = torch.zeros((100,), device=d0)
    tensor1 = torch.zeros((100,), device=d1)
    # (torch's test creates both on the default streams and writes them on others with no
    # wait: on a GPU the zeros are long done by then; the checker sees the race)
    mod.synchronize(0)
    mod.synchronize(1)
    parent = torch.futures.Future(devices=[d0, d1])

    def cb(fut):
        tensor1.copy_(fut.value(), non_blocking=True)
        return tensor1

    child = parent.then(cb)
    _fill_on_side_stream(mod, tensor0, parent)
    with mod.device(1):
        with mod.stream(mod.Stream(d1)):
            assert torch.eq(child.wait(), 1).all().item()

    # test_cuda_future_value_on_bad_device
    tensor0 = torch.zeros((100,), device=d0)
    tensor1 = torch.zeros((100,), device=d1)
    mod.synchronize(0)
    mod.synchronize(1)
    parent = torch.futures.Future(devices=[d1])

    def cb1(fut):
        with mod.device(1):
            tensor1.fill_(1)
            return tensor1

    child = parent.then(cb1)
    _fill_on_side_stream(mod, tensor0, parent)
    with pytest.raises(ValueError, match=rf"The result contained tensors residing on device\(s\) "
                                         rf"{dev}:0 which are not among the expected device\(s\) {dev}:1"):
        parent.wait()
    with mod.device(1):
        with mod.stream(mod.Stream(d1)):
            assert torch.eq(child.wait(), 1).all().item()

    # the checker sees what a Future without devices= does not order (dgtest only)
    if dev != "cuda":
        from distgrad.testing import accel
        plain = torch.futures.Future()
        t = torch.zeros(8, device=d0)
        side = mod.Stream(d0)
        side.wait_stream(mod.current_stream(d0))
        with mod.stream(side):
            t.fill_(2)
            plain.set_result(t)
        with accel.expect_violation("stream-order violation"):
            with mod.stream(mod.Stream(d0)):
                (plain.wait() + 1).sum()
            del t, plain
        accel.clear_violations()
    out.append(_violations())
    return out


def test_options_startup_checks_and_futures():
    """Options, torch's start-up validation of every worker's maps (test_device_maps_*,
    test_devices_option_mismatch*), the default ``devices``, and Future(devices=)."""
    _skip_without_devices()
    ports = [free_port() for _ in range(8)]
    res = run_workers(_options_and_futures, world_size=2, timeout=240, init=False, args=(ports,))
    for r in res:
        assert r[-1] == []                              # the checker stayed silent
    assert res[0][:6] == res[1][:6]                     # every worker found the same problem
    dev = res[0][6][0].split(":")[0]
    assert res[0][6] == [f"{dev}:0"] and res[1][6] == [f"{dev}:1"]


# ---------------------------------------------------------------- group 2: calls through maps

def _calls_through_maps(rank, world, port):
    dev = _device()
    mod = _mod(dev)
    d0, d1 = torch.device(dev, 0), torch.device(dev, 1)
    me, peer = f"worker{rank}", f"worker{(rank + 1) % world}"
    # to the peer: 0 <-> 1 (test_device_maps_gpu); to myself: device 0 -> the CPU and the
    # CPU -> device 1 (so replies to myself: device 1 -> the CPU, the CPU -> device 0)
    opts = _opts(port, device_maps={peer: {0: 1, 1: 0}})
    opts.set_device_map(me, {0: "cpu"})
    opts.set_device_map(me, {"cpu": 1})
    _init(rank, world, opts)
    agent = rpc.api._get_current_rpc_agent()
    assert agent.devices == [d0, d1]

    # test_device_maps_gpu: the reply comes back through the reverse map
    ret = rpc.rpc_sync(peer, _gpu_add, args=(torch.zeros(2).to(0), torch.ones(2).to(0)))
    assert ret.device == d1 and ret.cpu().tolist() == [1.0, 1.0]

    # test_device_maps_multi_gpu / test_device_maps_in_options
    rets = rpc.rpc_sync(peer, _gpu_add_multi_gpu, args=(torch.zeros(2).to(0), torch.ones(2).to(1)))
    assert rets[0].device == d1 and rets[1].device == d0
    assert rets[0].cpu().tolist() == [1.0, 1.0] and rets[1].cpu().tolist() == [-1.0, -1.0]

    # an error comes back through a future made with devices= as it does without
    with pytest.raises(ValueError, match="Wrong device affinity"):
        rpc.rpc_async(peer, _gpu_add, args=(torch.zeros(2), torch.zeros(2))).wait()

    # test_device_map_gpu_mixed_*: every combination through {0: 1, 1: 0}
    for x_from, y_from, z_to in [(0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (0, 0, 1), (1, 1, 0)]:
        m = {0: 1, 1: 0}
        ret = rpc.rpc_sync(peer, _gpu_add_given_devices,
                           args=(torch.zeros(2).to(x_from), torch.ones(2).to(y_from), m[x_from],
                                 m[y_from], z_to))
        assert ret.device == torch.device(dev, m[z_to]) and ret.cpu().tolist() == [1.0, 1.0]

    # test_device_map_gpu_to_cpu_default, to myself through {0: "cpu"}: the result
    # comes back through the reverse map {"cpu": 0}
    ret = rpc.rpc_sync(me, _gpu_add_given_devices,
                       args=(torch.zeros(2).to(0), torch.ones(2).to(0), "cpu", "cpu", "cpu"))
    assert ret.device == d0 and ret.cpu().tolist() == [1.0, 1.0]
    # test_device_map_cpu_to_gpu_non_default, to myself through {"cpu": 1}: back on the CPU
    ret = rpc.rpc_sync(me, _gpu_add_given_devices, args=(torch.zeros(2), torch.ones(2), 1, 1, 1))
    assert ret.device == torch.device("cpu") and ret.tolist() == [1.0, 1.0]

    # mixed CPU and device tensors in one call, with their flags (a Parameter, a
    # tensor that requires grad, a non-contiguous view) and the same tensor twice
    x = torch.arange(6.0, device=d0).reshape(2, 3)
    p = torch.nn.Parameter(torch.ones(3, device=d1))
    g = torch.ones(2, requires_grad=True)
    c = torch.full((2,), 7.0)
    seen = rpc.rpc_sync(peer, _where, args=(x, x.t(), p, g, c))
    assert seen == [(f"{dev}:1", False, "Tensor", True), (f"{dev}:1", False, "Tensor", False),
                    (f"{dev}:0", True, "Parameter", True), ("cpu", True, "Tensor", True),
                    ("cpu", False, "Tensor", True)]
    back = rpc.rpc_sync(peer, _echo, args=(x, c, x.t()))
    assert back[0].device == d0 and back[1].device == torch.device("cpu")
    assert torch.equal(back[0].cpu(), x.cpu()) and torch.equal(back[2].cpu(), x.t().cpu())
    # views keep their strides both ways, as torch rebuilds them from their storage: a
    # transposed view, and an expanded one (its span travels: 12 bytes, not 48 KiB)
    e = torch.arange(3.0, device=d0).reshape(3, 1).expand(3, 4096)
    assert rpc.rpc_sync(peer, _layouts, args=(x.t(), e)) == [((1, 3), 24), ((1, 0), 12)]
    assert back[2].stride() == (1, 3) and back[2].device == d0
    e_back = rpc.rpc_sync(peer, _echo, args=(e,))[0]
    assert (e_back.stride(), e_back.untyped_storage().nbytes(), e_back.device) == ((1, 0), 12, d0)
    assert torch.equal(e_back.cpu(), e.cpu())

    # test_custom_stream / test_custom_stream_multi: the callee works on a stream of its own
    x = torch.ones(2, 2).to(0)
    assert torch.equal(rpc.rpc_sync(peer, _slow_add_on_user_stream, args=(x, x)).cpu(), 2 * x.cpu())
    futs = [rpc.rpc_async(peer, _slow_add_on_user_stream, args=(x * i, x * i)) for i in range(10)]
    with mod.stream(mod.Stream(d0)):   # waited on, and read, on another stream
        total = [f.wait().sum().item() for f in futs]
    assert total == [8.0 * i for i in range(10)]

    # then chains: each link's future orders its readers after the previous one
    fut = rpc.rpc_async(peer, _add_to, args=(torch.ones(3).to(0), 1, 0))    # arrives on peer's 1
    chained = fut.then(lambda f: f.value() * 2).then(lambda f: f.value() + 1)
    with mod.stream(mod.Stream(d1)):
        v = chained.wait()
        assert v.device == d1 and v.sum().item() == 15.0

    # test_async_execution_with_cuda_future: set on a stream of the callee's own
    t = torch.zeros((100,), device=d0)
    fut = rpc.rpc_async(peer, _async_set_to_one, args=(t,))
    with mod.stream(mod.Stream(d0)):
        assert torch.eq(fut.wait(), 1).all().item()

    # test_device_maps_remote: a remote() value, fetched through the reverse map
    rref = rpc.remote(peer, _add_to_gpu, args=(torch.zeros(2).to(1), 1))   # on the peer's 0
    v = rref.to_here()
    assert v.device == d1 and v.cpu().tolist() == [1.0, 1.0]
    holder = rpc.remote(peer, _Holder, args=(f"{dev}:1",))
    assert holder.rpc_sync().where() == f"{dev}:1"
    r = holder.rpc_sync().add(torch.ones(4).to(0))                          # peer's 1 -> my 0
    assert r.device == d0 and r.cpu().tolist() == [1.0, 2.0, 3.0, 4.0]
    r = holder.remote().add(torch.ones(4).to(0)).to_here()
    assert r.device == d0 and r.cpu().tolist() == [1.0, 2.0, 3.0, 4.0]
    with mod.stream(mod.Stream(d0)):
        r = holder.rpc_async().add(torch.ones(4).to(0)).wait()
        assert r.sum().item() == 10.0
    # an RRef to a value on my device 1, fetched by the peer: it arrives on its device 0
    local = rpc.RRef(torch.arange(3.0, device=d1))
    assert rpc.rpc_sync(peer, _rref_value_device, args=(local,)) == (f"{dev}:0", [0.0, 1.0, 2.0])

    # an RRef in a reply held by a future made with devices= (torch's search for tensors
    # skips it), its value fetched through the reverse map
    theirs = rpc.rpc_async(peer, _own_rref, args=(f"{dev}:1",)).wait()
    assert theirs.to_here().device == d0

    # a device the map to that destination lacks: refused at the caller, torch's text
    # (test_device_maps_missing_config: to myself, whose map names device 0 and the CPU)
    before = rpc.rpc_sync(me, _calls)
    with pytest.raises(RuntimeError, match="TensorPipe RPC backend only supports CPU tensors by "
                                           "default.*`set_device_map` on `TensorPipeRpcBackendOptions`"
                       ) as ei:
        rpc.rpc_sync(me, _count_call, args=(torch.zeros(2).to(1),))
    assert str(ei.value).endswith(f"Request device mapping is not available for destination {me} "
                                  f"for device {dev}:1 but received a tensor on that device.")
    assert rpc.rpc_sync(me, _calls) == before                       # nothing was sent
    assert rpc.rpc_sync(me, torch.add, args=(torch.ones(2), 1)).tolist() == [2.0, 2.0]

    # a reply on a device the reverse map lacks: refused by the callee (its error comes
    # back; test_device_maps_missing_config_response)
    with pytest.raises(RuntimeError, match=f"Response device mapping is not available for destination "
                                           f"{me} for device {dev}:0"):
        rpc.rpc_sync(me, _add_to, args=(torch.zeros(2), 1, 0))
    assert rpc.rpc_sync(me, _add_to, args=(torch.zeros(2), 1, 1)).device == torch.device("cpu")
    assert rpc.rpc_sync(me, torch.add, args=(torch.ones(2), 1)).tolist() == [2.0, 2.0]

    # RemoteModule on the peer's device 1; with a map to the peer, the output comes back
    # on the device (through the reverse map: the peer's 1 is my 0)
    from distgrad.nn import RemoteModule
    rm = RemoteModule(f"{peer}/{dev}:1", _Affine, args=(4, 3))
    assert rm.is_device_map_set
    y = rm.forward(torch.ones(2, 4))
    assert y.device == d0 and y.cpu().tolist() == [[9.0] * 3] * 2
    with mod.stream(mod.Stream(d0)):
        y = rm.forward_async(torch.ones(2, 4).to(1)).wait()     # my 1 -> the peer's 0 -> its 1
        assert y.sum().item() == 54.0
    rpc.shutdown()
    return _violations()


def test_calls_and_replies_through_maps():
    """Calls, replies, mixed CPU/device, user streams, then chains, async_execution,
    remote/to_here, RRef proxies, missing maps and RemoteModule, through a map and its
    reverse, with the checker on."""
    _skip_without_devices()
    res = run_workers(_calls_through_maps, world_size=2, timeout=300, init=False, args=(free_port(),))
    assert res == [[], []]


# ---------------------------------------------------------------- group 3: no maps at all

def _no_maps(rank, world, port):
    dev = _device()
    mod = _mod(dev)
    d1 = torch.device(dev, 1)
    me, peer = f"worker{rank}", f"worker{(rank + 1) % world}"
    _init(rank, world, _opts(port))   # torch's test_device_maps_missing_config*: plain options
    assert rpc.api._get_current_rpc_agent().devices == []
    for dst in (peer, me):
        msg = ("TensorPipe RPC backend only supports CPU tensors by default, please move your tensors "
               "to CPU before sending them over RPC, or call `set_device_map` on "
               "`TensorPipeRpcBackendOptions` to explicitly configure device mapping. Request device "
               f"mapping is not available for destination {dst}, but found tensor on device: {dev}:0")
        before = rpc.rpc_sync(dst, _calls)
        with pytest.raises(RuntimeError) as ei:
            rpc.rpc_sync(dst, _count_call, args=(torch.ones(1), torch.zeros(2).to(0)))
        assert str(ei.value) == msg
        with pytest.raises(RuntimeError) as ei:                         # ..._missing_config_remote
            rpc.remote(dst, torch.add, args=(torch.zeros(2).to(0), 1)).to_here()
        assert str(ei.value) == msg
        assert rpc.rpc_sync(dst, _calls) == before                      # nothing was sent
        # ..._missing_config_response[_remote]: the callee refuses its reply
        reply = (f"Response device mapping is not available for destination {me}, but found tensor on "
                 f"device: {dev}:0")
        with pytest.raises(RuntimeError, match=reply):
            rpc.rpc_sync(dst, _add_to_gpu, args=(torch.zeros(2), 1))
        if dst == peer:   # (to myself, remote() gives the owner's RRef: nothing travels)
            with pytest.raises(RuntimeError, match=reply):
                rpc.remote(dst, _add_to_gpu, args=(torch.zeros(2), 1)).to_here()
        # test_device_maps_missing_config_loop / _not_timeout: refused at once, again and again
        for _ in range(20):
            with pytest.raises(RuntimeError, match="TensorPipe RPC backend only supports CPU tensors"):
                rpc.rpc_async(dst, torch.add, args=(torch.zeros(2).to(0), 1))
        assert rpc.rpc_sync(dst, torch.add, args=(torch.ones(2), 1)).tolist() == [2.0, 2.0]

    # RemoteModule without a map to its owner: inputs moved there, outputs back on the CPU
    from distgrad.nn import RemoteModule
    for owner in (peer, me):
        rm = RemoteModule(f"{owner}/{dev}:1", _Affine, args=(4, 3))
        assert not rm.is_device_map_set
        y = rm.forward(torch.ones(2, 4))
        assert y.device == torch.device("cpu") and y.tolist() == [[9.0] * 3] * 2
    # a local value on a device: a plain future (no devices here)
    local = rpc.RRef(torch.ones(2, device=d1))
    with mod.device(1):
        assert local.to_here().device == d1
    rpc.shutdown()
    return _violations()


def test_no_maps_refused_with_torchs_messages():
    """Without any map: a device tensor in a request is refused at the caller (rpc_sync,
    rpc_async, remote; nothing is sent) and one in a reply by the callee, with torch's
    texts; RemoteModule still runs on a device (outputs back on the CPU)."""
    _skip_without_devices()
    res = run_workers(_no_maps, world_size=2, timeout=300, init=False, args=(free_port(),))
    assert res == [[], []]


# ---------------------------------------------------------------- group 4: a dynamic group

def _dynamic(rank, world, rdv_port, coord_port):
    from datetime import timedelta

    import torch.distributed as dist
    dev = _device()
    mod = _mod(dev)
    d0, d1 = torch.device(dev, 0), torch.device(dev, 1)
    coord = dist.TCPStore("127.0.0.1", coord_port, None, is_master=False,
                          timeout=timedelta(seconds=120), wait_for_workers=False)
    me, peer = f"worker{rank}", f"worker{1 - rank}"

    def wait(key):
        coord.wait([key], timedelta(seconds=120))

    if rank == 0:   # the first member: a map to a worker that has not joined yet
        rpc.init_rpc(me, rank=0, rpc_backend_options=_opts(rdv_port, device_maps={peer: {0: 1}}))
        coord.set("up0", "1")
    else:
        wait("up0")
        # a joiner whose map names a device the member lacks: refused, torch's message
        count = mod.device_count()
        bad = _opts(rdv_port, device_maps={peer: {0: count}})
        with pytest.raises(ValueError, match="Node worker1 has target devices with invalid indices in "
                                             "its device map for worker0"):
            rpc.init_rpc(me, rank=1, rpc_backend_options=bad)
        assert not rpc.api._is_current_rpc_agent_set()
        rpc.init_rpc(me, rank=1, rpc_backend_options=_opts(rdv_port, device_maps={peer: {1: 0}}))
        coord.set("up1", "1")
    wait("up1")
    agent = rpc.api._get_current_rpc_agent()
    # worker0: its map to worker1 {0: 1} and worker1's {1: 0} to it (brought by the joiner)
    # worker1: its map {1: 0} and worker0's {0: 1} (in worker0's answer to its hello)
    assert agent.devices == ([d0] if rank == 0 else [d1])
    if rank == 0:
        assert rpc.rpc_sync(peer, _where, args=(torch.zeros(2).to(0),)) == [(f"{dev}:1", False, "Tensor",
                                                                              True)]
        ret = rpc.rpc_sync(peer, _add_to, args=(torch.zeros(2).to(0), 1, 1))   # its 1 -> my 0
        assert ret.device == d0 and ret.cpu().tolist() == [1.0, 1.0]
    else:
        fut = rpc.rpc_async(peer, _add_to, args=(torch.ones(2).to(1), 1, 0))  # its 0 -> my 1
        with mod.stream(mod.Stream(d1)):
            ret = fut.wait()
            assert ret.device == d1 and ret.sum().item() == 4.0
    coord.set(f"done{rank}", "1")
    wait(f"done{1 - rank}")
    if rank == 1:
        # it leaves, and its next incarnation has no map to worker0: worker0 forgot the
        # first one's reverse map (torch erases it on leave), so a device tensor in its
        # reply is refused with torch's message, not placed by the departed one's map
        rpc.shutdown()
        rpc.init_rpc(me, rank=1, rpc_backend_options=_opts(rdv_port, devices=[1]))
        text = ("Response device mapping is not available for destination worker1, but found tensor "
                f"on device: {dev}:1")
        with pytest.raises(Exception, match=re.escape(text)):
            rpc.rpc_sync(peer, _add_to, args=(torch.zeros(2), 1, 1))
        assert rpc.rpc_sync(peer, torch.add, args=(torch.ones(2), 1)).tolist() == [2.0, 2.0]
        coord.set("again1", "1")
    else:
        wait("again1")
    rpc.shutdown()
    return _violations()


def test_dynamic_group_joiner_brings_its_maps():
    """A dynamic group: the joiner checks every member's maps with its own (a bad one
    refused with torch's message), gets their maps to it in their answers, and gives
    each member the reverse of its map to it: calls and replies flow both ways; a member
    forgets a departed worker's reverse map (its next incarnation without a map gets
    torch's refusal for a device tensor in a reply)."""
    _skip_without_devices()
    from datetime import timedelta

    import torch.distributed as dist
    coord_port = free_port()
    host = dist.TCPStore("127.0.0.1", coord_port, None, is_master=True, timeout=timedelta(seconds=120),
                         wait_for_workers=False)
    try:
        res = run_workers(_dynamic, world_size=2, timeout=300, init=False, args=(free_port(), coord_port))
    finally:
        del host
    assert res == [[], []]


def _square_sum(x):
    return (x * x).sum()


def _python_engine_refuses(rank, world, port):
    import time

    import distgrad.autograd as dist_autograd
    dev = _device()
    peer = f"worker{1 - rank}"
    _init(rank, world, _opts(port, device_maps={peer: {0: 1, 1: 0}}))
    out = None
    if rank == 0:
        x = torch.ones(3, device=f"{dev}:0", requires_grad=True)
        t0 = time.monotonic()
        with dist_autograd.context() as cid:
            loss = rpc.rpc_sync(peer, _square_sum, args=(x,))
            with pytest.raises(RuntimeError) as ei:
                dist_autograd.backward(cid, [loss.cpu()])
        out = (str(ei.value), time.monotonic() - t0,
               rpc.rpc_sync(peer, torch.add, args=(torch.ones(2), 1)).tolist())
    rpc.shutdown()
    return out, _violations()


def test_python_engine_refuses_a_device_pass_and_says_why():
    """Without the native engine (no compiler, DISTGRAD_NATIVE=0) a distributed backward
    through device tensors is refused at once, naming the reason; RPC stays usable."""
    _skip_without_devices()
    env = {r: {"DISTGRAD_NATIVE": "0"} for r in range(2)}
    res = run_workers(_python_engine_refuses, world_size=2, timeout=300, init=False,
                      args=(free_port(),), env_per_rank=env)
    (text, seconds, after), violations = res[0]
    assert text.find("needs distgrad's native engine") >= 0 and "accelerator tensors" in text, text
    assert "outside a distributed backward" not in text, text
    assert after == [2.0, 2.0] and seconds < 60 and violations == [] and res[1][1] == []


# ---------------------------------------------------------------- in this process: no device needed

def test_routes_and_torchs_texts():
    """Where a tensor goes and torch's texts when it cannot (devices named, never built)."""
    from distgrad.errors import SerializationError
    from distgrad.wire.devices import Route
    c0, c1, cpu = torch.device("cuda:0"), torch.device("cuda:1"), torch.device("cpu")
    base = ("TensorPipe RPC backend only supports CPU tensors by default, please move your tensors to "
            "CPU before sending them over RPC, or call `set_device_map` on `TensorPipeRpcBackendOptions` "
            "to explicitly configure device mapping. ")
    with pytest.raises(SerializationError) as ei:
        Route(None, "worker1").target(c0)
    assert str(ei.value) == base + ("Request device mapping is not available for destination worker1, "
                                    "but found tensor on device: cuda:0")
    assert isinstance(ei.value, RuntimeError)
    route = Route({c0: c1, cpu: c0}, "worker0", "Response", devices=[c0])
    assert route.target(c0) == c1 and route.cpu_target == c0
    with pytest.raises(SerializationError) as ei:
        route.target(c1)
    assert str(ei.value) == (base + "Request device mapping is not available for destination " + base
                             + "Response device mapping is not available for destination worker0 for "
                             "device cuda:1 but received a tensor on that device.")
    with pytest.raises(SerializationError, match=r"RPC detected that a user-function output tensor on "
                                                 r"device cuda:1\. This device is not one of the input "
                                                 r"tensor devices: cuda:0, which is not yet supported"):
        Route({c1: c0}, "worker0", "Response", devices=[c0]).target(c1)


def test_hostile_device_specs_are_protocol_errors():
    """A spec that sends a tensor to a device: checked like every other field; placed only
    on one of the receiver's devices."""
    from distgrad.errors import ProtocolError
    from distgrad.wire import dumps
    from distgrad.wire.devices import parse_target
    from distgrad.wire.pickler import check_specs, loads, tensor_frames
    data, tensors = dumps([torch.ones(3)])
    specs, buffers = tensor_frames(tensors)
    moved = [specs[0]._replace(devices=("cuda:0", "cuda:1"))]
    with pytest.raises(ProtocolError, match="this worker has no device maps"):
        loads(data, moved, buffers)
    allowed = {"cuda:0": torch.device("cuda:0")}
    with pytest.raises(ProtocolError, match="not one of this worker's devices"):
        loads(data, moved, buffers, place=lambda t, target: parse_target(target, allowed))
    assert loads(data, [specs[0]._replace(devices=("cuda:0", "cpu"))], buffers)[0].tolist() == [1.0] * 3
    for bad in [("cuda:0",), ("cuda:0", 1), ("", "cuda:0"), ("cuda:0", "x" * 65), "cuda:0"]:
        with pytest.raises(ProtocolError, match="malformed tensor devices"):
            check_specs((tuple(specs[0][:6]) + (bad,),))
    assert parse_target("cpu", allowed) is None and parse_target("cuda:0", allowed) == torch.device("cuda:0")


# ---------------------------------------------------------------- group 4: distributed backward

class _RemoteCompute(torch.nn.Module):
    """torch's ``MyRemoteCompute`` (dist_autograd_test.py)."""

    def forward(self, input):
        return input * 2.0


def _on_user_stream(x):
    """The forward on a stream of its own (its backward node then runs there: torch's
    engine orders it after the gradient that came over RPC on the current stream)."""
    mod = torch.get_device_module(x.device.type)
    s = mod.Stream(x.device)
    s.wait_stream(mod.current_stream(x.device))
    with mod.stream(s):
        y = (x * 3.0).sin()
    mod.current_stream(x.device).wait_stream(s)
    return y


class _Wrapper(torch.nn.Module):
    """torch's ``WrapperModule``: a layer moved to ``device``; its gradients in a context."""

    def __init__(self, model, device):
        super().__init__()
        self.model = model.to(device)

    def forward(self, x):
        return self.model(x)

    def gradients(self, ctx_id):
        import distgrad.autograd as dist_autograd
        grads = dist_autograd.get_gradients(ctx_id)
        return [(grads[p].cpu(), str(grads[p].device), str(p.device)) for p in self.model.parameters()]


class _Scale(torch.nn.Module):
    """A parameter on the owner's device ``index``: stepped there by DistributedOptimizer."""

    def __init__(self, index):
        super().__init__()
        dev = "cuda" if torch.cuda.is_available() and __import__("os").environ.get(
            "DISTGRAD_TEST_DEVICE", "") in ("", "auto", "cuda") else "dgtest"
        self.w = torch.nn.Parameter(torch.linspace(1.0, 2.0, 4, device=f"{dev}:{index}"))

    def forward(self, x):
        return x * self.w


def _param_rrefs(rref):
    return [rpc.RRef(p) for p in rref.local_value().parameters()]


def _weight(rref):
    w = rref.local_value().w
    return w.detach().cpu(), str(w.device)


_LEAF: dict = {}


def _make_leaf(index):
    dev = torch.device(_device(), index)
    _LEAF["w"] = torch.linspace(1.0, 2.0, 4, device=dev).requires_grad_()


def _leaf_on_side_stream(x):
    """The callee's leaf used on a side stream of its own (its accumulation runs there)."""
    w = _LEAF["w"]
    mod = _mod(w.device.type)
    side = mod.Stream(w.device)
    side.wait_stream(mod.current_stream(w.device))
    x.record_stream(side)
    with mod.stream(side):
        y = (x * w).sum()
    mod.current_stream(w.device).wait_stream(side)
    return y


def _read_leaf_on_user_stream(cid):
    import distgrad.autograd as dist_autograd
    w = _LEAF["w"]
    mod = _mod(w.device.type)
    with mod.stream(mod.Stream(w.device)):
        return (dist_autograd.get_gradients(cid)[w] * 1).cpu()


class _CpuGrad(torch.autograd.Function):
    """Identity whose backward hands back a gradient on the CPU (torch's engine refuses it)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g.cpu()


def _backward_through_maps(rank, world, port, data):
    dev = _device()
    import distgrad.autograd as dist_autograd
    from distgrad.graph import export_graph
    opts = _opts(port)
    for peer in range(world):   # torch's test_gradients_synchronizations: rank -> peer's index
        opts.set_device_map(f"worker{peer}", {rank: peer})
    _init(rank, world, opts)
    out = None
    if rank == 0:
        out = {}
        d0 = torch.device(dev, 0)
        dst = "worker1"
        # test_device_maps_backward_pass: the reverse of the map carries the gradients
        # (traced: the copies through host memory are spans naming device, stream, bytes)
        import json
        import os
        import tempfile

        import distgrad
        t1, t2 = data["t1"].to(d0).requires_grad_(), data["t2"].to(d0).requires_grad_()
        before = rpc._get_debug_info()["agent.device_bytes_to_host"].get(str(d0), 0)
        path = os.path.join(tempfile.mkdtemp(prefix="dg-devtrace-"), "t.json")
        with distgrad.trace(path), dist_autograd.context() as cid:
            res = rpc.rpc_sync(dst, torch.add, args=(t1, t2))
            assert res.device == d0
            dist_autograd.backward(cid, [res.sum()])
            g = dist_autograd.get_gradients(cid)
            out["add"] = [(g[t].cpu(), str(g[t].device)) for t in (t1, t2)]
        info = rpc._get_debug_info()
        out["staged"] = (info["agent.device_bytes_to_host"].get(str(d0), 0) - before,
                         info["agent.device_bytes_from_host"].get(str(d0), 0))
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        out["stage_spans"] = sorted({(e["name"], e["args"]["device"],
                                      e["args"]["stream"].split(" stream ")[0], e["args"]["bytes"])
                                     for e in events if e.get("cat") == "device" and e.get("ph") == "X"})
        # test_dist_autograd_sync_streams: an RRef'd module on the peer, ten passes
        remote_compute = rpc.remote(dst, _RemoteCompute)
        out["streams"] = []
        for inp, r in zip(data["inputs"], data["r"]):
            x = inp.to(d0).requires_grad_()
            with dist_autograd.context() as cid:
                loss = remote_compute.rpc_sync().forward(x).sum() * r
                dist_autograd.backward(cid, [loss])
                gx = dist_autograd.get_gradients(cid)[x]
                out["streams"].append((gx.cpu(), str(gx.device)))
        # test_gradients_synchronizations: a chain of layers, one per other worker
        layers = []
        for i, state in enumerate(data["layers"]):
            lin = torch.nn.Linear(state["weight"].shape[1], state["weight"].shape[0])
            lin.load_state_dict(state)
            layers.append(rpc.remote(f"worker{i + 1}", _Wrapper, args=(lin, i + 1)))
        x = data["x"].to(d0)
        with dist_autograd.context() as cid:
            for layer in layers:
                x = layer.rpc_sync().forward(x)
            assert x.device == d0
            dist_autograd.backward(cid, [x.sum()])
            out["layers"] = [layer.rpc_sync().gradients(cid) for layer in layers]
        # a forward on a user stream of the callee: its backward runs there, ordered
        # (the graph's nodes name their device and stream: the callee's sin on its own)
        x = data["t1"].to(d0).requires_grad_()
        with dist_autograd.context() as cid:
            loss = rpc.rpc_sync(dst, _on_user_stream, args=(x,)).sum()
            desc = export_graph(cid, os.path.join(os.path.dirname(path), "g.json"), roots=[loss])
            out["graph"] = sorted({(w["name"], n["name"], n.get("device"), n.get("stream", 0) != 0)
                                   for w in desc["workers"].values() for n in w["nodes"]
                                   if n.get("device")})
            dist_autograd.backward(cid, [loss])
            gx = dist_autograd.get_gradients(cid)[x]
            out["user_stream"] = (gx.cpu(), str(gx.device))
        # the caller's forward on a user stream: the gradient that comes back for its send
        # function is placed on the receiving thread's stream, and the send function runs on
        # the user stream (its forward's), which must wait for it and keep it (record_stream:
        # the next node frees it while the placing stream has not seen the user stream)
        x = data["t1"][:8].to(d0).requires_grad_()
        mod = _mod(dev)
        with dist_autograd.context() as cid:
            side = mod.Stream(d0)
            side.wait_stream(mod.current_stream(d0))
            with mod.stream(side):
                z = (rpc.rpc_sync(dst, torch.mul, args=(x * 2.0, 3.0)) * 5.0).cos()
            mod.current_stream(d0).wait_stream(side)
            dist_autograd.backward(cid, [z.sum()])
            gx = dist_autograd.get_gradients(cid)[x]
            out["caller_stream"] = (gx.cpu(), str(gx.device))
        # get_gradients orders its reader's stream after the accumulation, as torch's
        # context does (recordGradEvent, getGradients): a leaf whose forward ran on a side
        # stream, its gradient read on a third stream, here and on the callee
        w = data["t1"][:4].to(d0).requires_grad_()
        with dist_autograd.context() as cid:
            side = mod.Stream(d0)
            side.wait_stream(mod.current_stream(d0))
            with mod.stream(side):
                y = rpc.rpc_sync(dst, torch.mul, args=(w * 3.0, 2.0)).sum()
            mod.current_stream(d0).wait_stream(side)
            y.record_stream(mod.current_stream(d0))   # (made on the side stream, used here)
            rpc.rpc_sync(dst, _make_leaf, args=(1,))
            y = y + rpc.rpc_sync(dst, _leaf_on_side_stream, args=(x.detach()[:4],))
            dist_autograd.backward(cid, [y])
            # a second pass in the context: w's gradient is added into the held one in place
            # (on the side stream), and a reader must wait for that accumulation too
            with mod.stream(side):
                y2 = rpc.rpc_sync(dst, torch.mul, args=(w * 3.0, 2.0)).sum()
            mod.current_stream(d0).wait_stream(side)
            y2.record_stream(mod.current_stream(d0))
            dist_autograd.backward(cid, [y2])
            with mod.stream(mod.Stream(d0)):
                got_w = (dist_autograd.get_gradients(cid)[w] * 1).cpu()
            out["read_elsewhere"] = (got_w, rpc.rpc_sync(dst, _read_leaf_on_user_stream, args=(cid,)))
        out["dev"] = dev
        # DistributedOptimizer: a parameter on the owner's device steps there
        from distgrad.optim import DistributedOptimizer
        model = rpc.remote(dst, _Scale, args=(1,))
        opt = DistributedOptimizer(torch.optim.SGD, rpc.rpc_sync(dst, _param_rrefs, args=(model,)), lr=0.1)
        x = data["t1"][:4].to(d0)
        with dist_autograd.context() as cid:
            loss = model.rpc_sync().forward(x).sin().sum()
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
        out["stepped"] = rpc.rpc_sync(dst, _weight, args=(model,))
        del model, opt
        # a gradient on the wrong device: refused as torch's engine refuses it
        x = torch.ones(3, device=d0, requires_grad=True)
        with dist_autograd.context() as cid:
            y = rpc.rpc_sync(dst, torch.mul, args=(_CpuGrad.apply(x * 1), 2))
            with pytest.raises(RuntimeError) as ei:
                dist_autograd.backward(cid, [y.sum()])
            out["refused"] = str(ei.value)
        del remote_compute, layers
    rpc.shutdown()
    import clean_ref  # (tensors as bytes: a queue's shared-memory handles die with the worker)
    return clean_ref.pack((out, _violations()))


def test_backward_through_maps():
    """torch's device-map backward tests (dist_autograd_test.py: test_device_maps_backward_pass,
    test_dist_autograd_sync_streams, test_gradients_synchronizations) on the device under test,
    3 workers, each mapping its device to each peer's; gradients equal torch's local autograd of
    the same computation on the CPU (a process that never imported distgrad), each on its
    parameter's device, with no stream-order violation; a wrong-device gradient is refused
    with torch's engine's message."""
    _skip_without_devices()
    import clean_ref
    import context_ref
    gen = torch.Generator().manual_seed(44)
    layers = [torch.nn.Linear(20, 20) for _ in range(2)]
    data = {"t1": torch.rand(10, generator=gen), "t2": torch.rand(10, generator=gen),
            "inputs": [torch.rand(30, 40, generator=gen) for _ in range(10)],
            "r": [float(v) for v in torch.rand(10, generator=gen)],
            "layers": [lin.state_dict() for lin in layers], "x": torch.randn(50, 20, generator=gen)}
    want = clean_ref.shared().call(context_ref.device_backward_grads, data["t1"], data["t2"], data["inputs"],
                                   data["r"], data["layers"], data["x"])
    env = {r: {"DISTGRAD_TEST_DEVICES": "3"} for r in range(3)}
    res = run_workers(_backward_through_maps, world_size=3, timeout=300, init=False,
                      args=(free_port(), data), env_per_rank=env)
    res = [clean_ref.unpack(r) for r in res]
    assert [v for _, v in res] == [[], [], []]
    got = res[0][0]
    dev = got["dev"]
    assert ("worker1", "SinBackward0", f"{dev}:1", True) in got["graph"], got["graph"]   # a user stream
    assert ("worker1", "RecvRpcBackward", f"{dev}:1", False) in got["graph"], got["graph"]
    assert ("worker0", "SendRpcBackward", f"{dev}:0", False) in got["graph"], got["graph"]
    g, where = got["user_stream"]
    assert where == f"{dev}:0" and torch.allclose(g, want["user_stream"])
    g_w, g_leaf = got["read_elsewhere"]
    assert torch.equal(g_w, torch.full((4,), 12.0)), g_w   # two passes: 6 + 6
    assert torch.allclose(g_leaf, want["leaf_on_side_stream"]), g_leaf
    g, where = got["caller_stream"]
    assert where == f"{dev}:0" and torch.allclose(g, want["caller_stream"])
    # worker0 staged t1 and t2 (40 bytes each) and the gradient of res (that of a sum: one
    # element expanded, whose 4 bytes travel, as torch sends a view's storage); received
    # res and the gradient of t1 and t2 (one tensor: add's backward gives both the same,
    # the wire sends a tensor once, again 4 bytes); worker1 the same the other way
    assert got["staged"] == (84, 44), got["staged"]
    # one span per call and device staged (t1 and t2: 80 bytes), one per tensor placed
    assert got["stage_spans"] == [(name, f"{dev}:{i}", f"{dev}:{i}", n) for name, i, n in (
        ("place on device", 0, 4), ("place on device", 0, 40), ("place on device", 1, 4),
        ("place on device", 1, 40), ("stage to host", 0, 4), ("stage to host", 0, 80),
        ("stage to host", 1, 4), ("stage to host", 1, 40))], got["stage_spans"]
    for (g, where), w in zip(got["add"], want["add"]):
        assert where.endswith(":0") and torch.equal(g, w)
    for (g, where), w in zip(got["streams"], want["streams"]):
        assert where.endswith(":0") and torch.allclose(g, w)
    for i, (layer_got, layer_want) in enumerate(zip(got["layers"], want["layers"])):
        for (g, where, param_at), w in zip(layer_got, layer_want):
            assert where == param_at == f"{dev}:{i + 1}" and torch.allclose(g, w, atol=1e-5), (i, where)
    w, where = got["stepped"]
    assert where == f"{dev}:1" and torch.allclose(w, want["stepped"])
    assert "invalid gradient at index 0 - expected device" in got["refused"], got["refused"]
    assert "but got cpu" in got["refused"], got["refused"]
