"""Cases for alias_check.py: an op whose backward may hand a view of the incoming
gradient to a leaf; a tensor hook keeps the op result's gradient g; after backward
g.mul_(3). Each op function runs where the case says (locally, over RPC on worker1,
over RPC to worker0 itself)."""
import torch
import torch.nn.functional as F

KEPT = []


def keep(g):
    KEPT.append(g)


def mutate_here():
    n = 0
    with torch.no_grad():
        for g in KEPT:
            if g.is_sparse:
                g._values().mul_(3)
            else:
                g.mul_(3)
            n += 1
    KEPT.clear()
    return n


def _w(shape):
    return torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) / 7


def _finish(y):
    y.register_hook(keep)
    return (y * _w(y.shape)).sum()


def op_stack(a, b):
    return _finish(torch.stack([a, b]))


def op_cat0(a, b):
    return _finish(torch.cat([a, b], 0))


def op_cat1(a, b):
    return _finish(torch.cat([a, b], 1))


def op_view(a, b):
    return _finish(a.view(6)) + b.sum()


def op_reshape(a, b):
    return _finish(a.reshape(3, 2)) + b.sum()


def op_unsqueeze(a, b):
    return _finish(a.unsqueeze(0)) + b.sum()


def op_transpose(a, b):
    return _finish(a.t()) + b.sum()


def op_add_scalar(a, b):
    return _finish(a + 1) + b.sum()


def op_add_tensors(a, b):
    return _finish(a + b)


def op_clone(a, b):
    return _finish(a.clone()) + b.sum()


def op_expand_same(a, b):
    return _finish(a.expand(2, 3)) + b.sum()


def op_expand(a, b):
    return _finish(a[:1].expand(4, 3)) + b.sum()


def op_unbind(a, b):
    x, y = a.unbind(0)
    x.register_hook(keep)
    return (x * 2).sum() + (y * 3).sum() + b.sum()


def op_split(a, b):
    x, y = torch.cat([a, b], 0).split(2, 0)
    return _finish(x) + (y * 3).sum()


def op_select_of_cat(a, b):
    y = torch.cat([a, b], 0)
    y.register_hook(keep)
    return (y[1] * 2).sum() + (y[2:4] * 3).sum()


def op_keep_leaf(a, b):
    a.register_hook(keep)      # the leaf's own gradient is kept
    return (a * _w(a.shape)).sum() + b.sum()


def op_keep_leaf_of_stack(a, b):
    a.register_hook(keep)      # the leaf's gradient, an unbind view of stack's gradient
    return (torch.stack([a, b]) * _w((2, 2, 3))).sum()


def op_embedding_sparse(a, b):
    idx = torch.tensor([1, 0, 1])
    y = F.embedding(idx, a, sparse=True)
    return _finish(y) + b.sum()


def op_embedding_sparse_view(a, b):
    # g contiguous (3,3); values = g.reshape(-1, 3) view
    idx = torch.tensor([[1, 0, 1]])
    y = F.embedding(idx, a, sparse=True)
    return _finish(y) + b.sum()


OPS = [n for n in dir() if n.startswith("op_")]
