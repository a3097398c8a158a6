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


#: what the layers above RPC run when ``rpc.shutdown()`` starts on this worker, each
#: called with ``graceful`` before anything else of the shutdown (an error propagates as
#: the shutdown's, after the local shutdown completed); see :func:`at_shutdown`
SHUTDOWN_START: list[Callable[[bool], None]] = []
#: ... and when it ends: after the agent stopped serving, before the extensions'
#: ``on_shutdown`` and the transport's close (an error is logged, the shutdown goes on)
SHUTDOWN_END: list[Callable[[], None]] = []


def at_shutdown(start: Callable[[bool], None] | None = None,
                end: Callable[[], None] | None = None) -> None:
    """Have ``start(graceful)`` run first thing in every ``rpc.shutdown()`` of this
    process, and ``end()`` as it finishes: how a layer above RPC (the tracer, which RPC
    never imports) closes what it has open. Registered once, at the layer's import.

    Example::

        >>> at_shutdown(start=lambda graceful: print("closing", graceful))
        >>> rpc.shutdown()
        closing True
    """
    if start is not None:
        SHUTDOWN_START.append(start)
    if end is not None:
        SHUTDOWN_END.append(end)


#: distributed autograd's ``backward_async(context_id, roots, retain_graph)``, put here
#: by :mod:`distgrad.autograd` at its import (see :func:`provide_backward`); None until then
DIST_BACKWARD: Callable[..., Any] | None = None


def provide_backward(fn: Callable[..., Any]) -> None:
    """Install distributed autograd's ``backward_async``, the one ``RRef.backward(ctx)``
    runs on the owner: the way up to the layer above, which RPC never imports.

    Example (what ``distgrad.autograd`` does at its import)::

        >>> provide_backward(dist_autograd.backward_async)
        >>> rref.backward(cid)      # the owner runs dist_autograd.backward_async(cid, [value])
    """
    global DIST_BACKWARD
    DIST_BACKWARD = fn
