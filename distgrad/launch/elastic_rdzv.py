"""torchrun's elastic rendezvous with nothing unpickled from a store: the ``distgrad`` backend.

torch's ``c10d`` backend keeps the rendezvous state as a base64 pickle in a
TCPStore that torch binds on every interface, and every agent ``pickle.loads``
what it reads there every few seconds: whoever reaches that port (another
local user, another host; the key name is listed by ``list_keys()``) runs
code in the agent. The ``distgrad`` backend keeps torch's own rendezvous
logic (``DynamicRendezvousHandler``: rounds, ``--nnodes MIN:MAX``, restarts,
a node joining, heartbeats, ``last_call_timeout``...), and changes where its
state lives and what it looks like there:

- the state is JSON (:func:`state_to_json`), sealed under the key distgrad
  derives from the stretched ``DISTGRAD_SECRET`` (:class:`~.sealed.StoreSeal`),
  bound to the run id and the key, and versioned: every write is the previous
  version plus one (a compare-and-set), and an agent refuses a version below
  one it has seen, or the same version with other contents (a rollback or a
  replay), and a missing state once it saw one;
- the handler turns what it reads into torch's state object itself, from
  checked JSON; the pickle torch's state holder loads is one this process
  made from it (:meth:`SealedStateBackend.get_state`);
- a forged, altered or rolled-back state fails the rendezvous with
  ``RendezvousStateError`` naming the key and the store (the launch exits
  with a clear error; no code runs);
- one node and no endpoint: the state lives in this process (a ``HashStore``),
  so the rendezvous has no port at all; otherwise the agent that hosts the
  endpoint binds the address named (``--rdzv-endpoint``), not the wildcard
  (:func:`~.listen.host_store`);
- the store the workers get (torchrun's shared agent store, MASTER_ADDR /
  MASTER_PORT) is bound on this node's address (``--local-addr``), not the
  wildcard; distgrad's workers seal every entry they keep there.

``distgrad launch`` uses it by default (it registers it in this process;
plain ``torchrun`` does not know it: use ``distgrad launch``, which is
torchrun's parser and agent). Without ``DISTGRAD_SECRET`` the state is still JSON (no code can run)
but unauthenticated; ``distgrad launch`` makes a secret on one node and warns
on several.

Example::

    >>> from torch.distributed.elastic.rendezvous import RendezvousParameters
    >>> register()
    >>> params = RendezvousParameters("distgrad", "", "job1", 1, 1)
    >>> handler = create_handler(params)     # one node: no port
"""
from __future__ import annotations

import base64
import hashlib
import logging
import os
import pickle
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousParameters,
    RendezvousStateError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousInfo,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousTimeout,
    Token,
)
from torch.distributed.elastic.rendezvous.utils import (
    _matches_machine_hostname,
    parse_rendezvous_endpoint,
)

from ..errors import ProtocolError
from .listen import host_store
from .rdzv_state import _Bad, _own_state, state_from_json, state_to_json
from .rendezvous import describe, peek
from .sealed import StoreSeal

log = logging.getLogger(__name__)

NAME = "distgrad"
DEFAULT_PORT = 29400


def _secret() -> bytes | None:
    # read, not popped (transport.auth.secret_from_env pops it): the agent's
    # environment is its workers', started after this
    value = os.environ.get("DISTGRAD_SECRET")
    return os.fsencode(value) if value else None


# -- the backend ------------------------------------------------------------------

class SealedStateBackend(RendezvousBackend):
    """A ``RendezvousBackend`` keeping torch's rendezvous state as sealed, versioned
    JSON under ``distgrad/rdzv/<run id>/state`` in ``store`` (see the module
    docstring). ``secret`` None: read ``DISTGRAD_SECRET`` (not removed from the
    environment).

    Example::

        >>> backend = SealedStateBackend(dist.HashStore(), "job1", b"s3cret")
        >>> backend.get_state() is None          # no state yet
        True
    """

    def __init__(self, store: dist.Store, run_id: str, secret: bytes | None = None) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._store = store
        self._run_id = run_id
        self._key = f"distgrad/rdzv/{run_id}/state"
        self._seal = StoreSeal(secret if secret is not None else _secret(), describe(store),
                               attempt=f"rdzv|{run_id}")
        self._seen = 0                      # the newest version read or written
        self._seen_digest = b""
        if not self._seal.authenticated:
            log.warning("distgrad rendezvous %r: no DISTGRAD_SECRET: its state in %s is JSON (no "
                        "code can run from it) but not authenticated: anyone who reaches the "
                        "store can change the group", run_id, self._seal.where)

    @property
    def name(self) -> str:
        """See base class."""
        return NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class. Raises RendezvousStateError on a state that is forged,
        altered, rolled back or gone."""
        raw = self._call(peek, self._store, self._key)
        if raw is None:
            if self._seen:
                raise self._tampered(f"the state (version {self._seen} when last read) was "
                                     "deleted")
            return None
        return self._decode(raw)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """See base class: a compare-and-set from ``token`` (the raw value last read)."""
        if token is not None and not isinstance(token, bytes):
            got = self.get_state()
            return None if got is None else (*got, False)
        version = self._seen + 1
        value = {"v": version, "state": state_to_json(_own_state(state))}
        raw = self._seal.seal(self._key, value)
        current = self._call(self._store.compare_set, self._key, token or b"", raw)
        current = bytes(current)
        if current == raw:
            self._note(version, raw)
            return pickle.dumps(state_from_json(value["state"])), raw, True
        if not token and current == b"":   # torch's stores: missing key, empty expected
            return None
        bits, now = self._decode(current)
        return bits, now, False

    def _decode(self, raw: bytes) -> tuple[bytes, Token]:
        try:
            value = self._seal.open(self._key, raw, _check_value)
        except ProtocolError as e:
            raise RendezvousStateError(f"distgrad rendezvous {self._run_id!r}: {e}") from None
        if value is None:
            raise self._tampered(self._seal.tampered.get(self._key, "failed authentication"))
        version = value["v"]
        digest = hashlib.sha256(raw).digest()
        if version < self._seen:
            raise self._tampered(f"rolled back to version {version} after version {self._seen} "
                                 "was read (an old state replayed)")
        if version == self._seen and digest != self._seen_digest:
            raise self._tampered(f"two different states of version {version} (a replayed or "
                                 "forked state)")
        state = state_from_json(value["state"])
        self._note(version, raw)
        return pickle.dumps(state), raw

    def _note(self, version: int, raw: bytes) -> None:
        self._seen = version
        self._seen_digest = hashlib.sha256(raw).digest()

    def _tampered(self, what: str) -> RendezvousStateError:
        return RendezvousStateError(
            f"distgrad rendezvous {self._run_id!r}: its state under {self._key!r} in "
            f"{self._seal.where} was tampered with: {what}. Someone who can reach that store "
            "wrote to it; the rendezvous stops here (nothing read from it was run). Keep the "
            "store's port away from untrusted users, and set the same DISTGRAD_SECRET on every "
            "node")

    @staticmethod
    def _call(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (ValueError, RuntimeError, TimeoutError) as e:
            raise RendezvousConnectionError(
                f"the connection to the distgrad rendezvous store has failed: {e}") from e


def _check_value(value: Any) -> str | None:
    if type(value) is not dict or set(value) != {"v", "state"}:
        return f"expected {{'v': int, 'state': {{...}}}}, found {value!r:.80}"
    if type(value["v"]) is not int or value["v"] < 1:
        return f"a version must be an integer >= 1, found {value['v']!r:.40}"
    try:
        state_from_json(value["state"])
    except _Bad as e:
        return str(e)
    return None


# -- the handler --------------------------------------------------------------------

class DistgradRendezvousHandler(DynamicRendezvousHandler):
    """torch's ``DynamicRendezvousHandler`` with three changes:

    - the workers' store (torchrun's shared agent store, MASTER_ADDR:MASTER_PORT)
      listens on this node's address only (:func:`~.listen.host_store`);
    - rank 0 hosts a fresh one in every round, and every other rank reads its
      address in every round. torch 2.13 keeps the first one and publishes or reads
      the address only in a node's first round: a node joining a running group
      (``--nnodes 1:2``) then waited for it until the timeout (on torch's ``c10d``
      too), a node whose rank went 0, 1, 0 sent its workers to a store that was
      gone, and the workers of a group restarted for a newcomer met on a store that
      held the last group's distgrad keys;
    - the rendezvous store the agents use (their rank assignment, the workers'
      store address, the exit barrier) seals every value it sets and refuses one it
      gets that is not sealed (:class:`SealedAgentStore`): a writer of that store
      cannot hand a node a rank or a store of its choosing."""

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> dist.TCPStore:
        return host_store(master_addr, master_port, None, timedelta(seconds=300),
                          multi_tenant=True)

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class."""
        if self.use_agent_store:
            # the last round's workers are stopped by now: its store goes with them
            self._shared_tcp_store_server = None
            self._bootstrap_store_info = None
        return super().next_rendezvous()

    def _wrap_store(self, store: dist.Store) -> dist.Store:
        inner = super()._wrap_store(store)
        backend = self._state_holder._backend
        return SealedAgentStore(inner, backend._seal, backend._run_id,
                                f"torch.rendezvous.{self._settings.run_id}."
                                f"{self._state_holder.state.round}")


class SealedAgentStore(dist.Store):
    """The agents' rendezvous store (a ``PrefixStore`` of one round) with every value
    sealed (:class:`~.sealed.StoreSeal`: bound to the run id and the full key name,
    the round included). ``get``/``multi_get`` of a value that is not sealed raise
    ``RendezvousStateError`` naming the key; counters (``add``) and waits pass
    through (liveness hints only).

    Example::

        >>> s = SealedAgentStore(dist.PrefixStore("p", dist.HashStore()), StoreSeal(b"k", "x"),
        ...                      "job", "p")
        >>> s.set("a", "1"); s.get("a")
        b'1'
    """

    def __init__(self, inner: dist.Store, seal: StoreSeal, run_id: str, prefix: str) -> None:
        super().__init__()
        self._inner, self._seal, self._run_id, self._prefix = inner, seal, run_id, prefix

    def _full(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    def _sealed(self, key: str, value: Any) -> bytes:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        return self._seal.seal(self._full(key), {"value": base64.b64encode(raw).decode()})

    def _opened(self, key: str, raw: Any) -> bytes:
        try:
            value = self._seal.open(self._full(key), bytes(raw), _check_agent_value)
        except ProtocolError as e:
            raise RendezvousStateError(f"distgrad rendezvous {self._run_id!r}: {e}") from None
        if value is None:
            raise RendezvousStateError(
                f"distgrad rendezvous {self._run_id!r}: the agents' entry {self._full(key)!r} in "
                f"{self._seal.where} was tampered with: "
                f"{self._seal.tampered.get(self._full(key), 'not sealed')}. Someone who can "
                "reach that store wrote to it; the rendezvous stops here")
        return base64.b64decode(value["value"])

    def set(self, key: str, value: Any) -> None:  # noqa: D102 - torch.distributed.Store
        self._inner.set(key, self._sealed(key, value))

    def multi_set(self, keys: list, values: list) -> None:  # noqa: D102
        self._inner.multi_set(keys, [self._sealed(k, v) for k, v in zip(keys, values)])

    def get(self, key: str) -> bytes:  # noqa: D102
        return self._opened(key, self._inner.get(key))

    def multi_get(self, keys: list) -> list:  # noqa: D102
        return [self._opened(k, v) for k, v in zip(keys, self._inner.multi_get(keys))]

    def add(self, key: str, value: int) -> int:  # noqa: D102
        return self._inner.add(key, value)

    def check(self, keys: list) -> bool:  # noqa: D102
        return self._inner.check(keys)

    def wait(self, keys: list, timeout: timedelta | None = None) -> None:  # noqa: D102
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:  # noqa: D102
        return self._inner.delete_key(key)

    def num_keys(self) -> int:  # noqa: D102
        return self._inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:  # noqa: D102
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:  # noqa: D102
        return self._inner.timeout


def _check_agent_value(value: Any) -> str | None:
    if type(value) is not dict or set(value) != {"value"} or type(value["value"]) is not str:
        return f"expected {{'value': base64 text}}, found {value!r:.80}"
    try:
        base64.b64decode(value["value"], validate=True)
    except ValueError as e:
        return f"not base64: {e}"
    return None


def _store(params: RendezvousParameters) -> dist.Store:
    """Where the state lives: in this process for one node without an endpoint;
    else a TCPStore at the endpoint, hosted (bound on that address alone) by the
    agent whose host it names."""
    if not params.endpoint.strip():
        if params.max_nodes != 1:
            raise ValueError(f"the distgrad rendezvous of up to {params.max_nodes} nodes needs "
                             "--rdzv-endpoint HOST:PORT (the agent on HOST hosts the store)")
        return dist.HashStore()   # one node: nothing to reach, nothing listens
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    configured = params.get_as_bool("is_host")
    is_host = configured if configured is not None else _matches_machine_hostname(host)
    read_timeout = params.get_as_int("read_timeout", 60)
    if read_timeout is None or read_timeout <= 0:
        raise ValueError("The read timeout must be a positive integer.")
    timeout = timedelta(seconds=read_timeout)
    if is_host:
        try:
            store = host_store(host, port, None, timeout, multi_tenant=True)
            log.info("process %d hosts the distgrad rendezvous store on %s:%d", os.getpid(),
                     host, store.port)
            return store
        except Exception as e:  # noqa: BLE001 - another agent on this host has it: join it
            if configured:
                raise RendezvousConnectionError(
                    f"cannot host the distgrad rendezvous store on {host}:{port}: {e}") from e
    try:
        return dist.TCPStore(host, port, None, False, timeout, wait_for_workers=False)
    except (ValueError, RuntimeError, TimeoutError) as e:
        raise RendezvousConnectionError(
            f"cannot reach the distgrad rendezvous store at {host}:{port}: {e}") from e


def _timeout(params: RendezvousParameters, key: str) -> timedelta | None:
    value = params.get_as_int(key + "_timeout")
    return None if value is None else timedelta(seconds=value)


def create_handler(params: RendezvousParameters) -> DistgradRendezvousHandler:
    """The ``distgrad`` rendezvous handler for torchrun's agent. Takes torch's
    ``c10d`` options (``--rdzv-conf``): ``join_timeout``, ``last_call_timeout``,
    ``close_timeout``, ``heartbeat_timeout``, ``keep_alive_interval``,
    ``keep_alive_max_attempt``, ``read_timeout``, ``is_host``.

    Example::

        >>> handler = create_handler(RendezvousParameters("distgrad", "10.0.0.1:29400",
        ...                                               "job1", 1, 4, last_call_timeout=2))
    """
    store = _store(params)
    backend = SealedStateBackend(store, params.run_id)
    timeout = RendezvousTimeout(_timeout(params, "join"), _timeout(params, "last_call"),
                                _timeout(params, "close"), _timeout(params, "heartbeat"))
    keep_alive = params.get_as_int("keep_alive_interval", 5)
    attempts = params.get_as_int("keep_alive_max_attempt", 3)
    if keep_alive is None or attempts is None:
        raise TypeError("keep_alive_interval and keep_alive_max_attempt must be integers")
    return DistgradRendezvousHandler.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes, params.local_addr,
        timeout, keep_alive_interval=keep_alive, keep_alive_max_attempt=attempts)


def register() -> None:
    """Add the ``distgrad`` backend to torch's rendezvous registry (once).

    Example::

        >>> register()
        >>> # torchrun --rdzv-backend distgrad ... now finds it in this process
    """
    try:
        rendezvous_handler_registry.register(NAME, create_handler)
    except ValueError:
        pass   # already registered (with this creator, or a plugin's)

