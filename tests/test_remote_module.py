"""distgrad.nn.RemoteModule on real worker processes (torch's RemoteModule API)."""
from __future__ import annotations

import traceback
import types
import warnings

import pytest
import torch
import torch.nn as nn
from mp_utils import free_port, run_workers
from torch import Tensor

LR = 0.1


# ---------------------------------------------------------------------------
# modules and helpers (module-level: pickled by reference)
# ---------------------------------------------------------------------------
class MyModule(nn.Module):
    """torch's test module: returns its arguments reversed."""

    def __init__(self, first_arg, first_kwarg=-1):
        super().__init__()
        self.param1 = nn.Parameter(torch.full((1,), float(first_arg + first_kwarg)))

    def forward(self, tensor: Tensor, number: int, word: str = "default") -> tuple[str, int, Tensor]:
        return word, number, tensor


class MyModuleInterface:
    def forward(self, tensor: Tensor, number: int, word: str = "default") -> tuple[str, int, Tensor]:
        pass


with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript interfaces
    warnings.simplefilter("ignore", DeprecationWarning)
    MyModuleInterface = torch.jit.interface(MyModuleInterface)


class BadModule:
    def __init__(self, *args, **kwargs):
        pass


def _seeded(module: nn.Module, seed: int) -> nn.Module:
    """Weights from a private generator (modules are built concurrently on the owner's
    threads, so the global RNG would race)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


def _make_linear(in_f: int, out_f: int, seed: int) -> nn.Linear:
    return _seeded(nn.Linear(in_f, out_f), seed)


def _make_nested() -> nn.Module:
    m = nn.Sequential(nn.Linear(2, 2))
    m.scale = nn.Parameter(torch.ones(1))
    return m


def _training(module_rref):
    return module_rref.local_value().training


def _is_script(module_rref):
    return isinstance(module_rref.local_value(), torch.jit.ScriptModule)


def _use_here(rm, x):
    """On a third worker: a RemoteModule received over RPC, called there."""
    # torch's receiver puts the generated methods into the instance's __dict__
    d = rm.__dict__
    assert isinstance(d["forward"], types.MethodType) and d["forward"].__name__ == "forward"
    torch.testing.assert_close(d["forward"](x), d["forward_async"](x).wait())
    return (rm.forward(x), rm.forward_async(x).wait(), rm(x), sorted(rm.__dict__),
            rm.on, rm.device, rm.is_device_map_set, rm.is_scriptable)


def _use_typed_here(rm):
    return rm.forward(torch.ones(1), 2), rm.is_scriptable


def _ctx_grads(ctx_id, module_rref):
    import distgrad.autograd as dist_autograd
    grads = dist_autograd.get_gradients(ctx_id)
    return [grads[p].clone() for p in module_rref.local_value().parameters()]


def _params(module_rref):
    return [p.detach().clone() for p in module_rref.local_value().parameters()]


def _raises(exc, fn, *args, match: str = "", **kwargs):
    with pytest.raises(exc, match=match) as info:
        fn(*args, **kwargs)
    return info.value


# ---------------------------------------------------------------------------
# One set of three workers runs every scenario (a spawn costs more than a
# scenario); worker0 drives, each test checks its scenario's outcome.
# ---------------------------------------------------------------------------
def _scenarios(rank, world_size, pg_port):
    if rank != 0:
        return None
    out = {}
    for name, fn, args in (("api", _api, ()), ("train", _train, ()), ("ddp", _ddp_master, (pg_port,))):
        try:
            out[name] = ("ok", fn(*args))
        except BaseException:  # noqa: BLE001 - reported by that scenario's test
            out[name] = ("error", traceback.format_exc())
    return out


@pytest.fixture(scope="module")
def scenarios():
    return run_workers(_scenarios, world_size=3, timeout=180, args=(free_port(),))[0]


def _outcome(scenarios, name):
    status, value = scenarios[name]
    if status != "ok":
        pytest.fail(f"scenario {name} failed on worker0:\n{value}", pytrace=False)
    return value


# ---------------------------------------------------------------------------
# API (three workers: worker0 drives, modules on worker1, worker2 receives)
# ---------------------------------------------------------------------------
def _api():
    import distgrad.rpc as rpc
    from distgrad.errors import DistgradError
    from distgrad.nn import RemoteModule
    from distgrad.nn.remote_module import _RemoteModule

    x = torch.randn(3, 4)
    local = _make_linear(4, 2, 7)
    by_name = RemoteModule("worker1/cpu", _make_linear, args=(4, 2, 7))
    by_rank = RemoteModule("rank:1/cpu", _make_linear, (4, 2, 7))
    bare = RemoteModule("worker1", _make_linear, kwargs={"in_f": 4, "out_f": 2, "seed": 7})
    assert (by_name.on, by_rank.on, bare.on) == ("worker1", 1, "worker1")
    assert by_name.device == by_rank.device == bare.device == "cpu"
    want = local(x)
    for rm in (by_name, by_rank, bare):
        torch.testing.assert_close(rm.forward(x), want)
        fut = rm.forward_async(x)
        assert isinstance(fut, torch.futures.Future)
        torch.testing.assert_close(fut.wait(), want)
        torch.testing.assert_close(rm(x), want)  # nn.Module.__call__ -> forward

    # torch's MyModule: positional, keyword and default arguments
    mine = RemoteModule("worker1/cpu", MyModule, (1,), {"first_kwarg": 2})
    args = (torch.ones(1), 2, "3")
    assert mine.forward(*args) == tuple(reversed(args))
    assert mine.forward_async(torch.ones(1), 2, word="3").wait() == tuple(reversed(args))
    assert mine.forward(torch.ones(1), 5) == ("default", 5, torch.ones(1))

    # parameters, module RRef, train/eval
    prefs = mine.remote_parameters()
    assert len(prefs) == 1 and isinstance(prefs[0], rpc.RRef) and prefs[0].owner().name == "worker1"
    assert torch.equal(prefs[0].to_here(), torch.full((1,), 3.0))
    got = [p.to_here() for p in by_name.remote_parameters()]
    for g, w in zip(got, local.parameters(), strict=True):
        torch.testing.assert_close(g, w.detach())
    nested = RemoteModule("worker1/cpu", _make_nested)
    assert len(nested.remote_parameters()) == 3 and len(nested.remote_parameters(recurse=False)) == 1
    assert mine.get_module_rref() is mine.module_rref
    assert [p.item() for p in mine.get_module_rref().to_here().parameters()] == [3.0]
    assert mine.eval() is mine and rpc.rpc_sync("worker1", _training, (mine.get_module_rref(),)) is False
    mine.train()
    assert rpc.rpc_sync("worker1", _training, (mine.get_module_rref(),)) is True

    # nn.Module methods torch refuses on a RemoteModule
    for name, call_args in [("register_buffer", ("b", torch.ones(1))), ("add_module", ("m", None)),
                            ("cuda", ()), ("cpu", ()), ("to", ("cpu",)), ("float", ()),
                            ("state_dict", ()), ("load_state_dict", ({},)), ("named_parameters", ()),
                            ("modules", ()), ("zero_grad", ()), ("requires_grad_", ()),
                            ("register_forward_hook", (lambda *a: None,)), ("extra_repr", ())]:
        _raises(ValueError, getattr(mine, name), *call_args,
                match=f"Method ``{name}`` not supported for RemoteModule")
    _raises(ValueError, mine.parameters, match="Please use ``remote_parameters`` instead")

    # bad device strings, unknown workers, a class that is not a module, CUDA
    for bad in ("worker1/cuda:0/cuda:1", "/", "/cpu", "rank:x/cpu", "a:b:c/cpu"):
        _raises(ValueError, RemoteModule, bad, MyModule, (1,), match="Could not parse remote_device")
    _raises(ValueError, RemoteModule, "cpu", MyModule, (1,), match="names no worker")
    _raises(RuntimeError, RemoteModule, "worker1/foo", MyModule, (1,), match="device type at start")
    _raises(RuntimeError, RemoteModule, "worker1/", MyModule, (1,), match="must not be empty")
    _raises(RuntimeError, RemoteModule, "nobody/cpu", MyModule, (1,), match="nobody")
    _raises(RuntimeError, RemoteModule, "rank:9/cpu", MyModule, (1,), match="9")
    _raises(ValueError, RemoteModule("worker1/cpu", BadModule, (1,)).forward,
            match=r"Expect `module_cls\(\*args, \*\*kwargs\)` returns an instance of <class nn.Module>")
    cuda = RemoteModule("worker1/cuda:0", MyModule, (1,))
    if torch.cuda.is_available():  # pragma: no cover - no GPU on the test machines
        assert cuda.forward(torch.ones(1), 2)[2].device.type == "cpu"
    else:
        err = _raises(DistgradError, cuda.forward, torch.ones(1), 2, match="CUDA is not available")
        assert "'cuda:0'" in str(err) and "worker1" in str(err)

    # pickling: refused by plain pickle, allowed through RPC
    _raises(RuntimeError, torch.save, mine, "/dev/null", match="can only be pickled when using RPC")
    mine.new_attr = 1  # not one of the attributes that travel
    fwd, fwd_async, called, keys, on, device, mapped, scriptable = rpc.rpc_sync(
        "worker2", _use_here, (by_name, x))
    for out in (fwd, fwd_async, called):
        torch.testing.assert_close(out, want)
    assert keys == sorted(["on", "device", "is_device_map_set", "is_scriptable", "generated_methods",
                           "module_rref", "forward", "forward_async"])
    assert (on, device, mapped, scriptable) == ("worker1", "cpu", False, False)
    with pytest.warns(UserWarning, match="new_attr"):
        assert rpc.rpc_sync("worker2", _use_typed_here, (mine,)) == (("default", 2, torch.ones(1)), False)
    shared = rpc.rpc_sync("worker2", RemoteModule.init_from_module_rref,
                          ("worker1/cpu", by_name.get_module_rref()))
    torch.testing.assert_close(shared.forward(x), want)

    # the TorchScript interface: typed forward (defaults filled in here), scripted remote module
    typed = _RemoteModule("worker1/cpu", MyModule, (1,), _module_interface_cls=MyModuleInterface)
    assert typed.is_scriptable and rpc.rpc_sync("worker1", _is_script, (typed.module_rref,))
    assert typed.forward(torch.ones(1), 2) == ("default", 2, torch.ones(1))
    assert typed.forward_async(torch.ones(1), 2, "3").wait() == ("3", 2, torch.ones(1))
    _raises(TypeError, typed.forward, torch.ones(1), 2, "3", "extra")
    assert rpc.rpc_sync("worker2", _use_typed_here, (typed,)) == (("default", 2, torch.ones(1)), True)
    _raises(ValueError, _RemoteModule, "worker1", MyModule, (1,), _module_interface_cls=MyModule,
            match="must be a type object decorated by @torch.jit.interface")
    return True


@pytest.mark.timeout(200)
def test_remote_module_api(scenarios):
    assert _outcome(scenarios, "api") is True


def test_needs_rpc_and_parses_devices():
    from distgrad.errors import DistgradError
    from distgrad.nn import RemoteModule
    from distgrad.nn.device import parse_remote_device

    with pytest.raises(DistgradError, match="only works in RPC"):
        RemoteModule("worker1/cpu", nn.Linear, (2, 2))
    assert parse_remote_device("ps/cuda:1") == ("ps", "cuda:1")
    assert parse_remote_device("rank:3") == (3, "cpu")
    assert parse_remote_device("trainer0") == ("trainer0", "cpu")


# ---------------------------------------------------------------------------
# distributed autograd + DistributedOptimizer against local autograd
# ---------------------------------------------------------------------------
def _train():
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    from distgrad.nn import RemoteModule
    from distgrad.optim import DistributedOptimizer

    remote = RemoteModule("worker1/cpu", _make_linear, (4, 3, 1))
    head = _make_linear(3, 2, 2)
    opt = DistributedOptimizer(torch.optim.SGD,
                               remote.remote_parameters() + [rpc.RRef(p) for p in head.parameters()], lr=LR)
    ref, ref_head = _make_linear(4, 3, 1), _make_linear(3, 2, 2)
    ref_opt = torch.optim.SGD(list(ref.parameters()) + list(ref_head.parameters()), lr=LR)
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
        with dist_autograd.context() as cid:
            h = remote(x) if step == 0 else remote.forward_async(x).wait()
            loss = ((head(torch.tanh(h)) - y) ** 2).mean()
            dist_autograd.backward(cid, [loss])
            remote_grads = rpc.rpc_sync("worker1", _ctx_grads, (cid, remote.get_module_rref()))
            local_grads = dist_autograd.get_gradients(cid)
            opt.step(cid)
        ref_opt.zero_grad()
        ref_loss = ((ref_head(torch.tanh(ref(x))) - y) ** 2).mean()
        ref_loss.backward()
        torch.testing.assert_close(loss.detach(), ref_loss.detach())
        for got, p in zip(remote_grads, ref.parameters(), strict=True):
            torch.testing.assert_close(got, p.grad)
        for p, rp in zip(head.parameters(), ref_head.parameters(), strict=True):
            torch.testing.assert_close(local_grads[p], rp.grad)
            assert p.grad is None
        ref_opt.step()
    got = rpc.rpc_sync("worker1", _params, (remote.get_module_rref(),))
    for g_, w in zip(got, ref.parameters(), strict=True):
        torch.testing.assert_close(g_, w.detach())
    assert not torch.allclose(got[0], _make_linear(4, 3, 1).weight)  # it did move
    return True


@pytest.mark.timeout(200)
def test_backward_and_distributed_optimizer_match_local(scenarios):
    assert _outcome(scenarios, "train") is True


# ---------------------------------------------------------------------------
# pytorch/examples' ddp_rpc pattern: an EmbeddingBag RemoteModule on a parameter
# server, nn.Linear in DDP (gloo, trainers only) on two trainers, one
# DistributedOptimizer per trainer over both. worker0 is master and server.
# ---------------------------------------------------------------------------
NUM_EMB, DIM, CLASSES = 10, 4, 3


def _make_emb(seed: int) -> nn.Module:
    return _seeded(nn.EmbeddingBag(NUM_EMB, DIM, mode="sum"), seed)


def _batch(rank: int):
    g = torch.Generator().manual_seed(rank)
    return (torch.randint(0, NUM_EMB, (7,), generator=g), torch.tensor([0, 2, 5]),
            torch.randint(0, CLASSES, (3,), generator=g))


def _trainer(emb, pg_port: int, rank: int):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    from distgrad.optim import DistributedOptimizer

    # the process group is the trainers' own, on its own port (not RPC's rendezvous)
    dist.init_process_group("gloo", rank=rank - 1, world_size=2, init_method=f"tcp://127.0.0.1:{pg_port}")
    try:
        torch.manual_seed(rank)  # different on each trainer: DDP broadcasts trainer 1's
        fc = DDP(nn.Linear(DIM, CLASSES))
        fc0 = [p.detach().clone() for p in fc.parameters()]
        opt = DistributedOptimizer(torch.optim.SGD,
                                   emb.remote_parameters() + [rpc.RRef(p) for p in fc.parameters()], lr=LR)
        indices, offsets, target = _batch(rank)
        with dist_autograd.context() as cid:
            loss = nn.functional.cross_entropy(fc(emb(indices, offsets)), target)
            dist_autograd.backward(cid, [loss])
            grads = dist_autograd.get_gradients(cid)
            fc_grads = [grads[p].clone() for p in fc.parameters()]
            opt.step(cid)
        dist.barrier()
        return fc0, fc_grads, [p.detach().clone() for p in fc.parameters()]
    finally:
        dist.destroy_process_group()


def _ddp_master(pg_port):
    import distgrad.rpc as rpc
    from distgrad.nn import RemoteModule

    emb = RemoteModule("worker0/cpu", _make_emb, (5,))  # the server is this worker
    emb0 = _make_emb(5).weight.detach().clone()
    futs = [rpc.rpc_async(f"worker{r}", _trainer, (emb, pg_port, r)) for r in (1, 2)]
    trainers = [f.wait() for f in futs]
    out = emb0, rpc.rpc_sync("worker0", _params, (emb.get_module_rref(),))[0], trainers
    return _as_lists(out)  # tensors would go through the result queue as shared memory


def _as_lists(value):
    if isinstance(value, Tensor):
        return ("t", value.tolist())
    if isinstance(value, (list, tuple)):
        return [_as_lists(v) for v in value]
    return value


def _as_tensors(value):
    if isinstance(value, tuple) and value[0] == "t":
        return torch.tensor(value[1])
    if isinstance(value, list):
        return [_as_tensors(v) for v in value]
    return value


def _local_step(emb0: Tensor, fc0: list, rank: int):
    """One trainer's step in plain local autograd: (embedding grad, fc grads)."""
    emb = nn.EmbeddingBag(NUM_EMB, DIM, mode="sum")
    fc = nn.Linear(DIM, CLASSES)
    with torch.no_grad():
        emb.weight.copy_(emb0)
        for p, v in zip(fc.parameters(), fc0, strict=True):
            p.copy_(v)
    indices, offsets, target = _batch(rank)
    nn.functional.cross_entropy(fc(emb(indices, offsets)), target).backward()
    return emb.weight.grad, [p.grad for p in fc.parameters()]


@pytest.fixture
def ddp_run(scenarios):
    return _as_tensors(_outcome(scenarios, "ddp"))


@pytest.mark.timeout(200)
def test_ddp_rpc_pattern(ddp_run):
    emb0, emb1, trainers = ddp_run
    (fc0_a, grads_a, _), (fc0_b, grads_b, _) = trainers
    for a, b in zip(fc0_a, fc0_b, strict=True):  # DDP's initial broadcast
        torch.testing.assert_close(a, b)
    ref_emb_a, ref_fc_a = _local_step(emb0, fc0_a, 1)
    ref_emb_b, ref_fc_b = _local_step(emb0, fc0_b, 2)
    # the server's table: one SGD step with each trainer's gradient
    torch.testing.assert_close(emb1, emb0 - LR * ref_emb_a - LR * ref_emb_b)
    # DDP's average of the trainers' gradients reached each distributed autograd context
    # (as torch's reducer writes it into torch's context)
    for got_a, got_b, ga, gb in zip(grads_a, grads_b, ref_fc_a, ref_fc_b, strict=True):
        torch.testing.assert_close(got_a, (ga + gb) / 2)
        torch.testing.assert_close(got_b, (ga + gb) / 2)
    assert any(not torch.allclose(ga, gb) for ga, gb in zip(ref_fc_a, ref_fc_b))  # not vacuous


@pytest.mark.timeout(200)
def test_ddp_rpc_replicas_stay_in_sync(ddp_run):
    emb0, _, trainers = ddp_run
    (fc0, _, fc1_a), (_, _, fc1_b) = trainers
    _, ref_a = _local_step(emb0, fc0, 1)
    _, ref_b = _local_step(emb0, fc0, 2)
    for got_a, got_b, p0, ga, gb in zip(fc1_a, fc1_b, fc0, ref_a, ref_b, strict=True):
        want = p0 - LR * (ga + gb) / 2  # DDP averages the trainers' gradients
        torch.testing.assert_close(got_a, want)
        torch.testing.assert_close(got_b, want)
