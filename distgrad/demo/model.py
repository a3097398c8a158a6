"""The demo's model pieces and the owner-side objects that hold them.

``stage_specs(n)`` splits a 64 -> 128 -> ... -> 10 MLP into ``n`` stages;
each stage and the parameter server's input normaliser live inside a
:class:`Shard` on their worker, referenced by the driver through an RRef.
A shard times the model code it runs (forward inside the remote call,
backward between its output's gradient hook and its last parameter's
gradient hook), so the demo can split step time honestly into compute and
everything else.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch
from torch import nn

IN_FEATURES = 64
HIDDEN = 128
CLASSES = 10


class Normalizer(nn.Module):
    """Learned per-pixel input scale and bias (held by the parameter server)."""

    def __init__(self, dim: int = IN_FEATURES) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.bias


def stage_specs(n_stages: int) -> list[list[tuple[int, int, bool]]]:
    """Layers of each stage as (in, out, relu) triples.

    1 stage: 64->128 ReLU 128->10; 2 stages: [64->128 ReLU] [128->10];
    n stages: [64->128 ReLU] [128->128 ReLU] * (n-2) [128->10].
    """
    if n_stages < 1:
        raise ValueError("need at least one model stage")
    first, last = (IN_FEATURES, HIDDEN, True), (HIDDEN, CLASSES, False)
    if n_stages == 1:
        return [[first, last]]
    return [[first]] + [[(HIDDEN, HIDDEN, True)] for _ in range(n_stages - 2)] + [[last]]


class Stage(nn.Sequential):
    """One model stage: Linear layers, each optionally followed by ReLU."""

    def __init__(self, spec: Sequence[tuple[int, int, bool]]) -> None:
        layers: list[nn.Module] = []
        for i, o, relu in spec:
            layers.append(nn.Linear(i, o))
            if relu:
                layers.append(nn.ReLU())
        super().__init__(*layers)


def describe_spec(spec: Sequence[tuple[int, int, bool]]) -> str:
    return " + ".join(f"Linear({i},{o})" + (" + ReLU" if r else "") for i, o, r in spec)


def build_module(kind: str, spec, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Normalizer() if kind == "normalizer" else Stage(spec)


class Shard:
    """Owner-side holder of one model piece; the driver calls it through an RRef.

    Example (on the driver)::

        shard = rpc.remote("stage1", Shard, args=("stage", spec, 1))
        h = shard.rpc_sync().forward(x)
    """

    def __init__(self, kind: str, spec=None, seed: int = 0) -> None:
        self.module = build_module(kind, spec, seed)
        self.lock = threading.Lock()
        self.forward_s = 0.0
        self.backward_s = 0.0
        self.calls = 0
        self._bw_start: float | None = None
        self._bw_end: float | None = None
        for p in self.module.parameters():
            p.register_hook(self._param_hook)

    # -- model code (timed) ------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.module(x)
        dt = time.perf_counter() - t0
        with self.lock:
            self._fold_backward()
            self.forward_s += dt
            self.calls += 1
        if out.requires_grad:
            out.register_hook(self._out_hook)
        return out

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def _out_hook(self, grad: torch.Tensor) -> None:
        with self.lock:
            self._fold_backward()
            self._bw_start = time.perf_counter()

    def _param_hook(self, grad: torch.Tensor) -> None:
        with self.lock:
            self._bw_end = time.perf_counter()

    def _fold_backward(self) -> None:
        if self._bw_start is not None and self._bw_end is not None and self._bw_end >= self._bw_start:
            self.backward_s += self._bw_end - self._bw_start
        self._bw_start = self._bw_end = None

    # -- plumbing -------------------------------------------------------------
    def parameter_rrefs(self) -> list:
        from ..rpc import RRef
        return [RRef(p) for p in self.module.parameters()]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def gradients(self, context_id: int) -> list[torch.Tensor | None]:
        """This shard's gradients in distributed autograd context ``context_id``
        (parameter order), read from the context, not from ``.grad``."""
        from .. import autograd as dist_autograd
        grads = dist_autograd.get_gradients(context_id)
        return [grads.get(p) for p in self.module.parameters()]

    def timing(self, reset: bool = False) -> dict[str, float]:
        with self.lock:
            self._fold_backward()
            out = {"forward_s": self.forward_s, "backward_s": self.backward_s, "calls": self.calls}
            if reset:
                self.forward_s = self.backward_s = 0.0
                self.calls = 0
        return out


def traffic_sent() -> dict[str, tuple[int, int]]:
    """(messages, bytes) this worker sent to each peer so far (``rpc._get_debug_info``)."""
    from .. import rpc
    info = rpc._get_debug_info()
    return {k[len("peer."):]: (v["messages_sent"], v["bytes_sent"]) for k, v in info.items()
            if k.startswith("peer.") and isinstance(v, dict)}
