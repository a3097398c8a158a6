"""Argument checks of ``backward``, with torch's messages."""
from __future__ import annotations

from typing import Any

import torch


def check_roots(roots: Any, grad_tensors: Any) -> tuple[list, list]:
    """Validate ``roots`` (and ``grad_tensors``); returns the roots and their gradients
    (ones for scalar roots without one)."""
    if not roots:
        raise RuntimeError("No tensors provided for gradient computation.")
    if grad_tensors is not None:
        if isinstance(grad_tensors, torch.Tensor):
            grad_tensors = [grad_tensors]
        if len(grad_tensors) != len(roots):
            raise RuntimeError(f"grad_tensors has {len(grad_tensors)} tensors for {len(roots)} roots")
    grads = []
    for i, r in enumerate(roots):
        if not isinstance(r, torch.Tensor):
            raise TypeError(f"backward(): incompatible function arguments. root {i} is a "
                            f"{type(r).__name__}, not a tensor")
        if not r.requires_grad:
            raise RuntimeError("requires_grad not set on root")
        g = grad_tensors[i] if grad_tensors is not None else None
        if g is None:
            if r.numel() != 1:
                raise RuntimeError(f"Tensor of shape {tuple(r.shape)} is not a scalar, all roots "
                                   "need to be scalar (or pass grad_tensors)")
            g = torch.ones_like(r)
        elif g.shape != r.shape:
            raise RuntimeError(f"grad_tensors[{i}] has shape {tuple(g.shape)}, root has "
                               f"{tuple(r.shape)}")
        if r.grad_fn is None:
            raise RuntimeError(f"Tensor of shape {tuple(r.shape)} does not have a valid gradient "
                               "function.")
        grads.append(g)
    return list(roots), grads
