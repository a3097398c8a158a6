"""Device maps: torch's ``TensorPipeRpcBackendOptions`` rules, for every accelerator.

torch's device maps are CUDA-only; distgrad applies the same rules to every
accelerator type torch knows (``cuda``, ``xpu``, ``mps``, ``mtia``, ``hpu``,
``maia`` and the PrivateUse1 backend under its name, e.g. the test device
``dgtest``), with torch's error texts:

* the options (:func:`to_device`, :func:`to_device_map`): a map is 1-to-1,
  ``devices`` lists accelerator devices only;
* at start-up every worker publishes its device counts (per type), its maps and
  its ``devices`` with its address (:func:`local_entry`, in the rendezvous
  exchange); every worker then checks all of them (:func:`validate`, torch's
  ``_validate_device_maps``: names, duplicates, indices within each peer's device
  count, ``devices`` covering the maps) and derives the reverse maps (how replies
  come back) and its own ``devices`` when none were given (its maps' sources and
  the targets of the maps peers have to it);
* :func:`install` gives the agent its routes (:class:`~distgrad.wire.devices.Route`:
  requests through the worker's own map, replies through the reverse one) and the
  devices a received tensor may be placed on. The futures of calls are created
  with ``devices=`` those devices (:func:`new_future`).

Example::

    >>> to_device_map({"cuda:0": 1})
    {device(type='cuda', index=0): device(type='cuda', index=1)}
"""
from __future__ import annotations

from typing import Any

import torch

from ..wire.devices import Route

# accelerator types whose devices a map or ``devices`` may name (with PrivateUse1's name)
_ACCELERATORS = ("cuda", "xpu", "mps", "mtia", "hpu", "maia")


def accelerator_types() -> tuple[str, ...]:
    """The device types that count as accelerators here: torch's, and the PrivateUse1
    backend under its current name.

    Example::

        >>> "cuda" in accelerator_types()
        True
    """
    return _ACCELERATORS + (torch._C._get_privateuse1_backend_name(),)


def to_device(device: Any) -> torch.device:
    """One entry of ``devices`` (int, str or torch.device) as a torch.device;
    ValueError with torch's text for a device that is not an accelerator's.

    Example::

        >>> to_device("cuda:1")
        device(type='cuda', index=1)
    """
    dev = torch.device(device)
    if dev.type not in accelerator_types():
        raise ValueError("`set_devices` expect a list of CUDA devices, but got "
                         f"device type {dev.type}.")
    return dev


def to_device_map(device_map: dict) -> dict[torch.device, torch.device]:
    """A device map (keys and values: int, str or torch.device) as torch.device
    pairs; ValueError with torch's text when two sources map to one target.

    Example::

        >>> to_device_map({"cpu": "cuda:0"})
        {device(type='cpu'): device(type='cuda', index=0)}
    """
    full: dict[torch.device, torch.device] = {}
    reverse: dict[torch.device, torch.device] = {}
    for k, v in device_map.items():
        k, v = torch.device(k), torch.device(v)
        if v in reverse:
            raise ValueError("`device_map` only supports 1-to-1 mapping, "
                             f"trying to map {k} and {reverse[v]} to {v}")
        full[k] = v
        reverse[v] = k
    return full


def device_counts() -> dict[str, int]:
    """How many devices of each accelerator type this process has (``cuda`` always,
    0 without CUDA, as torch counts; the others where present).

    Example::

        >>> device_counts()["cuda"]
        0
    """
    counts = {"cuda": torch.cuda.device_count()}
    name = torch._C._get_privateuse1_backend_name()
    for kind in ("xpu", "mtia", "hpu", "maia", name):
        if kind == "privateuseone" or kind in counts:
            continue
        try:
            mod = torch.get_device_module(kind)
        except (RuntimeError, AttributeError, ValueError):
            continue
        try:
            n = int(mod.device_count())
        except Exception:  # noqa: BLE001 - a backend whose module cannot count
            continue
        if n:
            counts[kind] = n
    try:
        if torch.backends.mps.is_available():
            counts["mps"] = 1
    except Exception:  # noqa: BLE001 - no MPS backend module
        pass
    return counts


# ---------------------------------------------------------------- the start-up exchange

def local_entry(opts: Any) -> dict:
    """This worker's part of the rendezvous exchange (JSON): its device counts, maps
    and devices.

    Example::

        >>> local_entry(rpc.TensorPipeRpcBackendOptions(device_maps={"w1": {0: 1}}))["maps"]
        {'w1': {'cuda:0': 'cuda:1'}}
    """
    maps = getattr(opts, "device_maps", None) or {}
    devices = getattr(opts, "devices", None) or []
    return {"counts": device_counts(),   # (peers' maps to this worker are checked against it)
            "maps": {str(to): {str(k): str(v) for k, v in m.items()} for to, m in maps.items()},
            "devices": [str(d) for d in devices]}


def parse_entry(name: str, value: Any) -> tuple[dict, dict, list]:
    """(counts, maps, devices) of a worker's exchanged entry (None: a worker that
    sent none, no maps); ValueError naming the worker when it is malformed.

    Example::

        >>> parse_entry("w1", {"counts": {"cuda": 2}, "maps": {"w0": {"cuda:1": "cuda:0"}},
        ...                    "devices": []})[1]
        {'w0': {device(type='cuda', index=1): device(type='cuda', index=0)}}
    """
    if value is None:
        return {"cuda": 0}, {}, []
    try:
        counts = {str(k): int(v) for k, v in value["counts"].items()}
        maps = {str(to): {torch.device(k): torch.device(v) for k, v in m.items()}
                for to, m in value["maps"].items()}
        devices = [torch.device(d) for d in value["devices"]]
    except Exception as e:  # noqa: BLE001 - whatever is wrong with it
        raise ValueError(f"Node {name} published a malformed device entry: {type(e).__name__}: {e}") \
            from None
    return counts, maps, devices


def _valid(devices: Any, counts: dict) -> bool:
    """torch's ``_tensorpipe_validate_devices``, for every accelerator type."""
    return all(d.type == "cpu" or (d.index is not None and 0 <= d.index < counts.get(d.type, 0))
               for d in devices)


def _count(counts: dict, devices: Any) -> Any:
    """The device count torch prints: that of the devices' type (a dict when mixed)."""
    kinds = {d.type for d in devices if d.type != "cpu"}
    if len(kinds) == 1:
        return counts.get(kinds.pop(), 0)
    return counts


def validate(all_names: list, all_counts: dict, all_maps: dict, all_devices: dict,
             is_static_group: bool = True) -> None:
    """torch's ``_validate_device_maps`` (same checks, same messages), with device
    indices checked against the count of each device's own type.

    Example::

        >>> validate(["w0", "w1"], {"w0": {"cuda": 2}, "w1": {"cuda": 2}},
        ...          {"w0": {"w1": {torch.device("cuda:0"): torch.device("cuda:3")}}, "w1": {}},
        ...          {"w0": [], "w1": []})
        Traceback (most recent call last):
        ValueError: Node w0 has target devices with invalid indices in its device map for w1 ...
    """
    for node in all_names:
        devices = all_devices[node]
        if len(set(devices)) != len(devices):
            raise ValueError(f"Node {node} has duplicated devices\ndevices = {devices}")
        if not _valid(devices, all_counts[node]):
            raise ValueError(f"Node {node} has devices with invalid indices\n"
                             f"devices = {devices}\n"
                             f"device count = {_count(all_counts[node], devices)}")
    for source in all_names:
        if is_static_group and not set(all_maps[source].keys()).issubset(all_names):
            raise ValueError(f"Node {source} has invalid target node names in its device maps\n"
                             f"device maps = {all_maps[source].keys()}\n"
                             f"node names = {all_names}")
        for target, map_ in all_maps[source].items():
            if len(set(map_.values())) != len(map_):
                raise ValueError(f"Node {source} has duplicated target devices in its device map "
                                 f"for {target}\ndevice map = {map_}")
            if all_devices[source]:
                if not set(map_.keys()).issubset(all_devices[source]):
                    raise ValueError(f"Node {source} has unexpected source devices in its device map "
                                     f"for {target}\ndevice map = {map_}\n"
                                     f"devices = {all_devices[source]}")
            elif not _valid(map_.keys(), all_counts[source]):
                raise ValueError(f"Node {source} has source devices with invalid indices in its device "
                                 f"map for {target}\ndevice map = {map_}\n"
                                 f"device count = {_count(all_counts[source], map_.keys())}")
            if all_devices.get(target, []):
                if not set(map_.values()).issubset(all_devices[target]):
                    raise ValueError(f"Node {source} has unexpected target devices in its device map "
                                     f"for {target}\ndevice map = {map_}\n"
                                     f"devices = {all_devices[target]}")
            elif target in all_counts and not _valid(map_.values(), all_counts[target]):
                raise ValueError(f"Node {source} has target devices with invalid indices in its device "
                                 f"map for {target}\ndevice map = {map_}\n"
                                 f"device count = {_count(all_counts[target], map_.values())}")


def reverse_maps(my_name: str, all_names: list, all_maps: dict) -> dict:
    """For each worker with a map to ``my_name``: that map reversed (how this worker's
    replies to it travel), torch's ``_create_reverse_mapping``.

    Example::

        >>> reverse_maps("w1", ["w0", "w1"], {"w0": {"w1": {cuda0: cuda1}}, "w1": {}})
        {'w0': {device(type='cuda', index=1): device(type='cuda', index=0)}}
    """
    out: dict[str, dict[torch.device, torch.device]] = {}
    for node in all_names:
        if my_name in all_maps[node]:
            out[node] = {v: k for k, v in all_maps[node][my_name].items()}
    return out


def device_list(my_devices: list, my_maps: dict, reverse: dict) -> list[torch.device]:
    """torch's ``_create_device_list``: the given devices, else every non-CPU source of
    this worker's maps and of its reverse maps; sorted by index. distgrad also
    requires them to be of one accelerator type (a future's ``devices=`` are).

    Example::

        >>> device_list([], {"w1": {cuda1: cuda0, cpu: cpu}}, {"w1": {cuda0: cuda1}})
        [device(type='cuda', index=0), device(type='cuda', index=1)]
    """
    if not my_devices:
        found: set[torch.device] = set()
        for map_ in my_maps.values():
            found.update(map_.keys())
        for map_ in reverse.values():
            found.update(map_.keys())
        found.discard(torch.device("cpu"))
        my_devices = list(found)
    my_devices = sorted(my_devices, key=lambda d: (d.type, d.index if d.index is not None else -1))
    kinds = {d.type for d in my_devices}
    if len(kinds) > 1:
        raise ValueError(f"distgrad moves tensors between devices of one accelerator type per worker, "
                         f"but the device maps and devices here name {sorted(kinds)}: "
                         f"devices = {my_devices}")
    return my_devices


def exchanged(my_name: str, names: list, entries: list, opts: Any) -> tuple[dict, dict, list]:
    """After the rendezvous exchange: check every worker's maps (ValueError, torch's
    messages) and return this worker's (maps, reverse maps, devices).

    Example::

        >>> maps, reverse, devices = exchanged("worker0", ["worker0", "worker1"],
        ...                                    [local_entry(opts0), local_entry(opts1)], opts0)
    """
    all_counts, all_maps, all_devices = {}, {}, {}
    for name, value in zip(names, entries):
        all_counts[name], all_maps[name], all_devices[name] = parse_entry(name, value)
    validate(list(names), all_counts, all_maps, all_devices)
    reverse = reverse_maps(my_name, list(names), all_maps)
    devices = device_list(all_devices[my_name], all_maps[my_name], reverse)
    return all_maps[my_name], reverse, devices


# ---------------------------------------------------------------- the agent's side

def install(agent: Any, maps: dict, reverse: dict, devices: list) -> None:
    """Give ``agent`` its device maps: the routes of requests (its own maps) and of
    replies (the reverse maps), and the devices received tensors may be placed on
    and its calls' futures are created with.

    Example::

        >>> install(agent, {"worker1": {cuda0: cuda1}}, {"worker1": {cuda1: cuda0}}, [cuda0, cuda1])
        >>> agent.request_routes["worker1"].target(cuda0)
        device(type='cuda', index=1)
    """
    agent.device_maps = {name: dict(m) for name, m in maps.items()}
    agent.request_routes = {name: Route(m, name, "Request") for name, m in maps.items() if m}
    _set_reverse(agent, {name: dict(m) for name, m in reverse.items()}, list(devices))


def _set_reverse(agent: Any, reverse: dict, devices: list) -> None:
    """The reverse maps and devices of ``agent``, and what follows from them (each
    replaced as a whole: the threads that read them never see half of a change)."""
    agent.devices = devices
    agent.device_targets = {str(d): d for d in devices}
    agent.reply_routes = {name: Route(m, name, "Response", devices) for name, m in reverse.items() if m}
    agent.reverse_device_maps = reverse


# ---------------------------------------------------------------- dynamic groups

def own_maps(opts: Any) -> tuple[dict, dict, list]:
    """(maps, reverse maps, devices) of a dynamic member before it has met anyone: its
    own maps (whose targets may not have joined yet), no reverse map.

    Example::

        >>> install(agent, *own_maps(opts))
    """
    maps = dict(getattr(opts, "device_maps", None) or {})
    return maps, {}, device_list(list(getattr(opts, "devices", None) or []), maps, {})


def join_dynamic(agent: Any, opts: Any, member_entries: dict, timeout: float) -> None:
    """A joiner of a dynamic group, once it has every member's device entry
    (``{name: entry}``, from their answers to its hello): check them all with its own
    (torch's checks for a dynamic group: a map may name a worker that has not joined),
    take its reverse maps and devices, and give each member it maps to the reverse of
    that map (:func:`_admit_map`). ValueError (init_rpc fails) when a check fails.

    Example::

        >>> join_dynamic(agent, opts, {"trainer0": entry0, "ps": entry1}, timeout=60)
    """
    me = agent.name
    names = list(member_entries) + [me]
    all_counts, all_maps, all_devices = {}, {}, {}
    for name, value in list(member_entries.items()) + [(me, local_entry(opts))]:
        all_counts[name], all_maps[name], all_devices[name] = parse_entry(name, value)
    validate(names, all_counts, all_maps, all_devices, is_static_group=False)
    reverse = reverse_maps(me, names, all_maps)
    install(agent, all_maps[me], reverse, device_list(all_devices[me], all_maps[me], reverse))
    for name, map_ in all_maps[me].items():
        if name in member_entries and map_:
            agent.call(name, _admit_map, (me, {str(k): str(v) for k, v in map_.items()}), {},
                       timeout, sync=True)


def _admit_map(name: str, map_: dict) -> None:
    """Runs on a member: worker ``name`` joined with this map to it; its reverse is how
    replies to ``name`` travel, and (where this worker's ``devices`` were not given)
    its targets join this worker's devices, as torch's members take a joiner's."""
    from .pending import current_agent
    agent = current_agent()
    forward = {torch.device(k): torch.device(v) for k, v in map_.items()}
    reverse = dict(agent.reverse_device_maps)
    reverse[name] = {v: k for k, v in forward.items()}
    devices = list(agent.devices)
    if not getattr(agent.options, "devices", None):
        devices += [d for d in forward.values() if d.type != "cpu" and d not in devices]
        devices = device_list(devices, {}, {})
    _set_reverse(agent, reverse, devices)


def forget(agent: Any, name: str) -> None:
    """Worker ``name`` left the group or was lost: its reverse map goes, and (where this
    worker's ``devices`` were not given) the devices no map uses any more, as torch's
    members erase them when a worker leaves (``updateGroupMembership``). A later worker
    under that name brings its own map (:func:`_admit_map`) or has none: a device tensor
    in a reply to it is then refused with torch's message, never placed by the old map.

    Example::

        >>> forget(agent, "worker1")
        >>> "worker1" in agent.reverse_device_maps
        False
    """
    reverse = getattr(agent, "reverse_device_maps", None)
    if not reverse or name not in reverse:
        return
    reverse = {n: m for n, m in reverse.items() if n != name}
    given = list(getattr(getattr(agent, "options", None), "devices", None) or [])
    devices = device_list([to_device(d) for d in given], getattr(agent, "device_maps", {}), reverse)
    _set_reverse(agent, reverse, devices)


def reply_route(agent: Any, name: str) -> Route:
    """The route of replies to ``name`` (made, and kept, on first use for a worker
    without a map to this one: it refuses device tensors with torch's message).

    Example::

        >>> reply_route(agent, "worker1").what
        'Response'
    """
    route = agent.reply_routes.get(name)
    if route is None:
        route = agent.reply_routes[name] = Route(agent.reverse_device_maps.get(name), name, "Response",
                                                 agent.devices)
    return route


def new_future(agent: Any = None) -> torch.futures.Future:
    """A future for a value that may hold tensors on this worker's devices: with
    ``devices=`` those devices where device maps are set (so that a waiter or a
    callback is ordered after the streams that produced the value), plain otherwise.

    Example::

        >>> fut = new_future(agent)       # Future(devices=[cuda:0, cuda:1]) with maps to them
    """
    devices = getattr(agent, "devices", None)
    return torch.futures.Future(devices=devices) if devices else torch.futures.Future()


def completed_future(agent: Any, value: Any) -> torch.futures.Future:
    """A future already holding ``value`` (a local RRef's): :func:`new_future`'s, or a
    plain one when ``value`` holds tensors on a device that is not one of this
    worker's devices (such a future would hold an error instead).

    Example::

        >>> completed_future(agent, torch.ones(2, device="cuda:0")).wait()
        tensor([1., 1.], device='cuda:0')
    """
    fut = new_future(agent)
    fut.set_result(value)
    if getattr(agent, "devices", None):
        try:
            fut.value()
        except Exception:  # noqa: BLE001 - "tensors residing on device(s) ... not among" them
            fut = torch.futures.Future()
            fut.set_result(value)
    return fut
