"""Hooks on a leaf's AccumulateGrad node run in a distributed backward
(DistAutogradTest.test_post_hooks), in native and node-by-node regions."""
import pytest
import torch
from mp_utils import run_workers

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad.autograd import node_hooks

pytestmark = pytest.mark.timeout(120)


def test_probe_finds_hooks_and_changes_nothing():
    t = torch.rand(3, requires_grad=True)
    a = t * 2
    node = a.grad_fn.next_functions[0][0]
    calls = []
    node.register_hook(lambda gi, go: calls.append(("post", gi, go[0].clone())))
    node.register_prehook(lambda go: calls.append(("pre", go[0].clone())))
    pre, post = node_hooks.hooks_of(node)
    assert len(pre) == 1 and len(post) == 1
    # probing a node without hooks finds none, and leaves none that runs
    bare = (torch.rand(2, requires_grad=True) * 1).grad_fn.next_functions[0][0]
    assert node_hooks.hooks_of(bare) == ([], [])
    # a hook registered after the probe is in the dicts the probe keeps
    bare.register_prehook(lambda go: None)
    assert len(node_hooks.hooks_of(bare)[0]) == 1
    # and the registered hooks still run, once each, in local autograd
    a.sum().backward()
    assert [c[0] for c in calls] == ["pre", "post"] and calls[1][1] == ()
    assert torch.equal(calls[1][2], torch.full((3,), 2.))


def test_leaf_hooks_see_a_registration_on_a_new_node():
    """A leaf found without hooks is not looked at again while nobody registers a hook
    (its next node is new, so hookless); a registration since is seen."""
    p = torch.rand(2, requires_grad=True)
    node = (p * 1).grad_fn.next_functions[0][0]
    assert node_hooks.leaf_hooks(node, p) == ([], [])
    del node
    node = (p * 1).grad_fn.next_functions[0][0]  # a new node
    assert node_hooks.leaf_hooks(node, p) == ([], [])
    assert node_hooks._KEY not in node.metadata  # no look was needed
    hook = lambda gos: None  # noqa: E731
    node.register_prehook(hook)
    assert node_hooks.leaf_hooks(node, p) == ([hook], [])
    # a post-accumulate-grad hook is not one of them: torch's distributed engine
    # never runs AccumulateGrad, which is what calls it
    p.register_post_accumulate_grad_hook(lambda t: None)
    assert node_hooks.leaf_hooks(node, p) == ([hook], [])


def test_tensor_hooks_run_by_the_engine_without_the_node():
    """run_tensor_hooks: a node's tensors' hooks and retain_grad, in torch's order, absent
    gradients as None; the node itself, its post-hooks and what lies behind do not run."""
    x = torch.ones(3, requires_grad=True)
    a, b = (x * 2).split(2)
    seen = []
    a.register_hook(lambda g: seen.append(("a", g)) or g * 10)
    b.register_hook(lambda g: seen.append(("b", g)))
    a.retain_grad()
    a.grad_fn.register_hook(lambda gi, go: seen.append("post"))
    out = node_hooks.run_tensor_hooks(a.grad_fn, [torch.ones(2), None])
    assert torch.equal(out[0], torch.full((2,), 10.)) and out[1] is None
    assert [s[0] for s in seen] == ["a", "b"] and seen[1][1] is None
    assert torch.equal(a.grad, torch.full((2,), 10.)) and x.grad is None


def _hooks(rank, ws):
    if rank != 0:
        return None
    log = []
    # torch's test: three post-hooks on one node (t + t reaches it twice): 1 + 2 + 2
    t = torch.rand(10, 10, requires_grad=True)
    a = t + t
    a.grad_fn.next_functions[0][0].register_hook(lambda gi, go: log.append(1) or gi)
    a.grad_fn.next_functions[0][0].register_hook(lambda gi, go: log.append(2) or gi)
    a.grad_fn.next_functions[1][0].register_hook(lambda gi, go: log.append(2) or gi)
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [a.sum()])
        assert sum(log) == 5
        grads = dist_autograd.get_gradients(cid)
        assert list(grads) == [t] and torch.equal(grads[t], torch.full((10, 10), 2.))
    assert t.grad is None

    # a leaf whose gradient comes back over RPC; a pre-hook replaces the gradient
    w = torch.ones(3, requires_grad=True)
    seen = []
    y = w * 1
    node = y.grad_fn.next_functions[0][0]
    node.register_prehook(lambda go: (go[0] * 10,))
    node.register_hook(lambda gi, go: seen.append(go[0].clone()))
    with dist_autograd.context() as cid:
        z = rpc.rpc_sync("worker1", torch.mul, args=(y, 3.0))
        dist_autograd.backward(cid, [z.sum()])
        g = dist_autograd.get_gradients(cid)[w]
    assert torch.equal(g, torch.full((3,), 30.)) and len(seen) == 1 and torch.equal(seen[0], g)
    assert w.grad is None

    # a shared region (y both sent and used locally): the node-by-node executor
    from distgrad.autograd.share import ENGINE
    def _shared():   # (one graph task on the native engine)
        return ENGINE.stats.get("passes_shared", 0) + ENGINE.stats.get("passes_graph_task", 0)
    shared = _shared()
    x = torch.ones(2, requires_grad=True)
    calls = []
    y = x * 2
    y.grad_fn.next_functions[0][0].register_hook(lambda gi, go: calls.append(go[0].clone()))
    with dist_autograd.context() as cid:
        z = rpc.rpc_sync("worker1", torch.mul, args=(y, 3.0))
        dist_autograd.backward(cid, [(z + y).sum()])
        g = dist_autograd.get_gradients(cid)[x]
    assert torch.equal(g, torch.full((2,), 8.)) and len(calls) == 1 and torch.equal(calls[0], g)
    assert _shared() == shared + 1
    return True


def test_accumulate_grad_hooks_in_distributed_backward():
    assert run_workers(_hooks, world_size=2, timeout=90) == [True, None]
