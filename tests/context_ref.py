"""Local halves of tests/test_context_lifetime.py's programs (imports no distgrad:
tests/clean_ref.py runs them in a process that never imported it)."""
import torch


def hook_program(call):
    """x1 * 2 used here, x2 * 3 sent to worker1 and back (``call`` is a plain call
    locally, rpc_sync distributed); hooks on both halves. Returns the leaves and
    the loss."""
    x1 = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    x2 = torch.tensor([3.0, -1.0], dtype=torch.float64, requires_grad=True)
    a = x1 * 2
    b = x2 * 3
    return (x1, x2), a, b, lambda b_: call("worker1", torch.mul, (b_, b_))


def local_grads():
    (x1, x2), a, b, remote = hook_program(lambda to, fn, args: fn(*args))
    (a.sum() + remote(b).sum()).backward()
    return [x1.grad, x2.grad]


def slow_hook_program(call, sleep):
    """x1 * 2 here with a hook that takes ``sleep`` seconds; x2 * 3 sent and back; x3
    both used here and sent (the caller's share is then a shared pass)."""
    x1 = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    x2 = torch.tensor([3.0, -1.0], dtype=torch.float64, requires_grad=True)
    x3 = torch.tensor([0.5, 4.0], dtype=torch.float64, requires_grad=True)
    a = x1 * 2
    a.register_hook(lambda g: sleep())
    s = x3 * 1
    loss = (a.sum() + call("worker1", torch.mul, (x2 * 3, x2)).sum() + s.sum()
            + call("worker1", torch.mul, (s, s)).sum())
    return (x1, x2, x3), loss


def slow_hook_grads():
    leaves, loss = slow_hook_program(lambda to, fn, args: fn(*args), lambda: None)
    loss.backward()
    return [t.grad for t in leaves]


def sin_program(call):
    """h = x.sin() sent to worker1 and back; SinBackward0 runs here only once the
    gradient came back."""
    x = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64, requires_grad=True)
    return x, call("worker1", torch.mul, (x.sin(), 1.0)).sum()


def sin_grads():
    x, loss = sin_program(lambda to, fn, args: fn(*args))
    loss.backward()
    return [x.grad]


def mixed_program(call):
    """w * 1.5 sent to worker0, which sends it doubled back to worker1 (nested) and adds
    1; the same tensor also goes to worker0 in a call whose result is never used."""
    w = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, requires_grad=True)
    h = w * 1.5
    y = call("worker0", "outer", h)
    call("worker0", "unused", h)
    return w, y.sum()


def mixed_grads():
    fns = {"outer": lambda t: (t * 2) * 3 + 1, "unused": torch.sin}
    w, loss = mixed_program(lambda to, name, t: fns[name](t))
    loss.backward()
    return [w.grad]


def partial_program(call):
    """(x * 2, q * 3) go to worker1, which returns only the first doubled: the send
    function's second slot is reached by no path (q has no gradient, q * 3's node never
    runs). Returns the leaves, the loss and the node of q * 3."""
    x = torch.tensor([1.0, -2.0], dtype=torch.float64, requires_grad=True)
    q = torch.tensor([3.0, 0.5], dtype=torch.float64, requires_grad=True)
    b = q * 3
    z = call("worker1", "first_doubled", (x * 2, b))
    return (x, q), z.sum(), b.grad_fn


def unused_reply_chain_program(call):
    """seed 7449/w3 of the round-2 generator, shrunk: r is sent to worker1, which
    returns it after an rpc_async to worker2 whose reply nobody uses; that result and
    r three times go to worker2, which returns the second argument."""
    r = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    r30 = call("worker1", "relay_after_unused_call", (r, r))
    r42 = call("worker2", "second_of_four", (r30, r, r, r))
    return (r,), r42 * 1.5


PARTIAL_FNS = {"first_doubled": lambda a, b: a * 2, "second_of_four": lambda a, b, c, d: b,
               "relay_after_unused_call": lambda a, b: a}


def local_call(to, name, args):
    return PARTIAL_FNS[name](*args)


def partial_grads():
    (x, q), loss, _ = partial_program(local_call)
    loss.backward()
    return [x.grad, q.grad]


def unused_reply_chain_grads():
    (r,), loss = unused_reply_chain_program(local_call)
    loss.backward()
    return [r.grad]


def two_passes_program(call):
    """z = times3(x * 1) over RPC; two backward passes of one context through z's one
    send function: (z * 1).sum() and (z * 2).sum(). Returns x and the two losses."""
    x = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    z = call("worker1", "times3", (x * 1,))
    return x, (z * 1).sum(), (z * 2).sum()


def two_passes_grads():
    x, l1, l2 = two_passes_program(lambda to, name, args: args[0] * 3)
    l1.backward(retain_graph=True)
    l2.backward()
    return [x.grad]


# -- distributed backward through device maps (tests/test_device_maps.py), on the CPU --

def device_backward_grads(t1, t2, inputs, r_values, layer_states, x) -> dict:
    """The gradients torch's local autograd gives the device-map backward scenarios,
    computed on the CPU: ``t1 + t2`` summed (torch's test_device_maps_backward_pass);
    ``input * 2`` summed times ``r`` for each (test_dist_autograd_sync_streams); and a
    chain of Linear layers from their state dicts (test_gradients_synchronizations)."""
    import torch
    out = {}
    a, b = t1.clone().requires_grad_(), t2.clone().requires_grad_()
    (a + b).sum().backward()
    out["add"] = [a.grad, b.grad]
    streams = []
    for inp, r in zip(inputs, r_values):
        i = inp.clone().requires_grad_()
        ((i * 2.0).sum() * r).backward()
        streams.append(i.grad)
    out["streams"] = streams
    layers = []
    for state in layer_states:
        lin = torch.nn.Linear(state["weight"].shape[1], state["weight"].shape[0])
        lin.load_state_dict(state)
        layers.append(lin)
    torch.nn.Sequential(*layers)(x).sum().backward()
    out["layers"] = [[p.grad for p in lin.parameters()] for lin in layers]
    u = t1.clone().requires_grad_()
    (u * 3.0).sin().sum().backward()
    out["user_stream"] = u.grad
    c = t1[:8].clone().requires_grad_()
    ((c * 2.0 * 3.0) * 5.0).cos().sum().backward()
    out["caller_stream"] = c.grad
    out["leaf_on_side_stream"] = t1[:4].clone()   # d(sum(x * w))/dw for x = t1[:4]
    w = torch.nn.Parameter(torch.linspace(1.0, 2.0, 4))
    opt = torch.optim.SGD([w], lr=0.1)
    (t1[:4] * w).sin().sum().backward()
    opt.step()
    out["stepped"] = w.detach()
    return out
