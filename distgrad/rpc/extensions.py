"""The hooks the layers above RPC (RRefs, distributed autograd) plug into the agent.

An extension module calls :func:`register_extension` at import; every agent
created afterwards builds one instance per registered factory and calls its
hooks on each message (see :class:`AgentExtension`).

Example::

    >>> class Counting(AgentExtension):
    ...     def __init__(self, agent):
    ...         self.sent = 0
    ...     def outgoing(self, dest, tensors, ctx):
    ...         self.sent += 1
    >>> register_extension(Counting)
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

EXTENSION_TYPES: list[Callable[[Any], AgentExtension]] = []


def register_extension(factory: Callable[[Any], AgentExtension]) -> None:
    """Have ``factory(agent)`` build an extension for every agent created from now on."""
    EXTENSION_TYPES.append(factory)


class AgentExtension:
    """Hooks for the layers above RPC (distributed autograd)."""

    def outgoing(self, dest: int, tensors: list, ctx: Any) -> Any:
        """Called before a message with ``tensors`` goes to ``dest``; returns meta."""
        return None

    def outgoing_if_grad(self, dest: int, tensors: list, ctx: Any) -> Any:
        """Called instead of :meth:`outgoing` for a message that carries the context
        only when it carries a tensor that requires grad (a reply, a builtin
        operator's call; torch's ``forceGradRecording=False``); by default as
        :meth:`outgoing`."""
        return self.outgoing(dest, tensors, ctx)

    def incoming(self, sender: int, meta: Any, reply: bool = False) -> Callable[[list], list] | None:
        """Returns a tensor hook for a received message's tensors (``reply``: of a
        reply to a call of this worker's), or None."""
        return None

    def request_scope(self, meta: Any):
        """A context manager the callee runs the user function under."""
        return NULL_SCOPE

    def current(self) -> Any:
        """What ``outgoing`` needs of the calling thread (e.g. its autograd context)."""
        return None

    def on_peer_lost(self, peer: int, reason: str) -> None:
        pass

    def on_shutdown(self) -> None:
        pass

    def debug_info(self) -> dict[str, Any]:
        """Counters merged into ``rpc._get_debug_info()``."""
        return {}


class _NullScope:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


NULL_SCOPE = _NullScope()
