"""Debug counters of the RPC layer, with torch's names and key sets."""
from __future__ import annotations

from typing import Any

from .agent import current_agent


def _get_debug_info() -> dict[str, Any]:
    """Agent statistics: pending calls, pool usage, messages and bytes per peer,
    the RRef context's counters, and (as torch merges them in) distributed
    autograd's ``num_autograd_contexts`` and ``num_current_backward_passes``.

    Example::

        >>> rpc._get_debug_info()["peer.worker1"]["messages_sent"]
        12
    """
    agent = current_agent()
    info = agent.debug_info()
    info.update(_rref_context_get_debug_info())
    for ext in agent.extensions:
        if ext is not agent.rrefs:
            info.update(ext.debug_info())
    return info


def _rref_context_get_debug_info() -> dict[str, str]:
    """torch's RRef counters, as strings like torch gives them: num_owner_rrefs,
    num_forks, num_pending_futures, num_pending_users.

    Example::

        >>> rpc._rref_context_get_debug_info()["num_owner_rrefs"]
        '0'
    """
    return {k: str(v) for k, v in current_agent().rrefs.debug_info().items()}


def enable_gil_profiling(flag: bool) -> None:
    """Turn on (or off) measuring how long requests wait to run Python.

    When on, ``agent.gil_average_wait_time_us`` appears in the agent's debug
    info: the mean time from a request's hand-off by the reading thread to the
    moment a pool thread runs it, which in a pure-Python agent is mostly the
    wait for the GIL.

    Example::

        >>> rpc.enable_gil_profiling(True)
        >>> rpc.api._get_current_rpc_agent().get_debug_info()["agent.gil_average_wait_time_us"]
        '41'
    """
    current_agent().set_gil_profiling(bool(flag))
