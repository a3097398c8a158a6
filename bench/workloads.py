"""The workloads ``bench/run_all.py`` runs, each on a fresh cluster per
implementation and repeat, and the table rows each one reports.

A workload names the existing bench function that rank 0 runs
(``worker_fn(rpc)`` returning a dict), its cluster size and options, its
timeout, and its rows. A row's ``target`` applies to the ratio
distgrad/torch (``ratio<=1``: distgrad at least as good as torch on a
lower-is-better figure) or to distgrad's own value (``distgrad<=1.05``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import autograd_bench
import fanout_bench
import graph_bench
import mesh_bench
import ps_bench
import rpc_bench
import small_calls_bench
import transformer_bench


@dataclass
class Row:
    key: str                # key in the workload's result dict
    label: str
    unit: str
    better: str             # "lower" | "higher"
    target: str | None      # "ratio<=1", "ratio>=1", "distgrad<=1.05", None
    fmt: str = ".1f"


@dataclass
class Workload:
    name: str
    world_size: int
    make_fn: object         # quick -> worker_fn(rpc) (picklable)
    rows: list
    timeout: float          # full run, seconds, per cluster
    quick_timeout: float
    cluster: dict = field(default_factory=dict)  # extra run_cluster kwargs
    about: str = ""


def _rpc(quick, **kw):
    return functools.partial(rpc_bench.rpc_workload, quick=quick, **kw)


BIG = ("16MB", "128MB")


def _bw_rows(suffix="", target="ratio>=2"):
    return [Row(f"bw_{s}_MBps", f"round-trip bandwidth {s}{suffix}", "MB/s", "higher",
                target, ".0f") for s in BIG]


def _mesh(n: int) -> Workload:
    """All-to-all among ``n`` workers (``mesh<n>``; mesh32's rows keep their names)."""
    p = "mesh" if n == 32 else f"mesh{n}"
    return Workload(f"mesh{n}", n, lambda q: functools.partial(
        mesh_bench.mesh_workload, world_size=n, quick=q, prefix=p), [
        Row(f"{p}_init_s", f"{n} workers: init_rpc", "s", "lower", "ratio<=0.5", ".2f"),
        Row(f"{p}_a2a_first_s", f"{n} workers: first all-to-all round", "s", "lower",
            "ratio<=0.5", ".3f"),
        Row(f"{p}_a2a_round_s", f"{n} workers: all-to-all round (warm)", "s", "lower",
            "ratio<=0.8", ".3f"),
        Row(f"{p}_cpu_us_per_call", f"{n} workers: CPU (all processes) per call", "us", "lower",
            None, ".0f"),
    ], 600, 420, cluster={"num_worker_threads": 8, "rpc_timeout": 300,
                          "shutdown_grace": 60}, about="mesh_bench.mesh_workload")


WORKLOADS = [
    Workload("latency", 2, lambda q: _rpc(q, parts=("latency",)), [
        Row("lat_median_us", "rpc_sync small-tensor round trip, median", "us", "lower",
            "ratio<=0.5"),
        Row("lat_p99_us", "rpc_sync small-tensor round trip, p99", "us", "lower", "ratio<=0.5"),
        Row("lat_cpu_us_per_call", "rpc_sync round trip: CPU (both processes) per call", "us",
            "lower", None, ".0f"),
    ], 300, 120, about="rpc_bench.measure_latency"),
    Workload("pipeline", 3, lambda q: functools.partial(
        autograd_bench.pipeline_workload, quick=q), [
        Row("pipe_sgd_steps_per_s", "3-worker pipeline training (fwd+bwd+SGD)", "steps/s",
            "higher", "ratio>=1.2"),
        Row("pipe_fb_steps_per_s", "3-worker pipeline fwd+bwd", "steps/s", "higher",
            "ratio>=1.2"),
    ], 400, 200, about="autograd_bench.pipeline_workload"),
    Workload("ps", 3, lambda q: functools.partial(
        ps_bench.ps_workload, warmup=5 if q else 10, steps=30 if q else 100), [
        Row("steps_per_s", "parameter server, 2 trainers", "steps/s", "higher", "ratio>=1.2"),
        Row("server_cpu_us_per_step", "parameter server: server CPU per step served", "us",
            "lower", None, ".0f"),
        Row("trainer_cpu_us_per_step", "parameter server: trainer CPU per step", "us",
            "lower", None, ".0f"),
    ], 300, 150, about="ps_bench.ps_workload"),
    Workload("fanout", 4, lambda q: functools.partial(fanout_bench.fanout_workload, quick=q), [
        Row("fanout_calls_per_s", "fan-out 64 x rpc_async(256 KB) over 3 peers", "calls/s",
            "higher", "ratio>=1.2", ".0f"),
        Row("fanout_cpu_us_per_call", "fan-out: CPU (all processes) per call", "us", "lower",
            "ratio<=0.5", ".0f"),
    ], 300, 120, about="fanout_bench.fanout_workload"),
    Workload("bandwidth", 2, lambda q: _rpc(q, parts=("bandwidth",), sizes=BIG),
             _bw_rows(), 300, 150, about="rpc_bench.measure_bandwidth"),
    Workload("bandwidth_tcp", 2, lambda q: _rpc(q, parts=("bandwidth",), sizes=BIG),
             _bw_rows(", distgrad shm off", "ratio>=1"), 300, 150,
             cluster={"env": {"DISTGRAD_SAME_HOST": "0"}},
             about="as bandwidth, workers get DISTGRAD_SAME_HOST=0: distgrad's cross-host "
                   "path (TCP, no shared memory; torch ignores it)"),
    Workload("local", 1, lambda q: functools.partial(autograd_bench.local_workload, quick=q), [
        Row("local_ratio", "local graph: dist_autograd.backward / loss.backward()", "x",
            "lower", None, ".3f"),
        Row("local_dist_ms", "local graph: dist_autograd.backward median", "ms", "lower",
            "ratio<=1", ".2f"),
    ], 300, 150, about="autograd_bench.local_workload"),
    Workload("graph_size", 1, lambda q: functools.partial(graph_bench.graph_size_workload, quick=q),
             [Row(f"gs{d}_ratio", f"graph size {d}x(Linear(16,16)+Tanh) (~{5 * d} nodes): "
                  "dist_autograd.backward / loss.backward()", "x", "lower", None, ".3f")
              for d in graph_bench.DEPTHS]
             + [Row(f"gs{d}_dist_ms", f"graph size {d}x(Linear+Tanh): dist_autograd.backward median",
                    "ms", "lower", "ratio<=1", ".2f") for d in graph_bench.DEPTHS],
             300, 150, about="graph_bench.graph_size_workload"),
    Workload("tf_local", 1, lambda q: functools.partial(transformer_bench.tf_local_workload, quick=q), [
        Row("tf_local_ratio", "12 transformer layers, local: dist_autograd.backward / loss.backward()",
            "x", "lower", None, ".3f"),
        Row("tf_local_dist_ms", "12 transformer layers, local: dist_autograd.backward median", "ms",
            "lower", "ratio<=1", ".2f"),
    ], 300, 150, about="transformer_bench.tf_local_workload"),
    Workload("tf_split", 2, lambda q: functools.partial(transformer_bench.tf_split_workload, quick=q), [
        Row("tf_split_steps_per_s", "12 transformer layers split 6+6 over 2 workers "
            "(fwd+bwd+DistributedOptimizer)", "steps/s", "higher", "ratio>=1.2"),
        Row("tf_split_bwd_ms", "12 transformer layers split: dist_autograd.backward median", "ms",
            "lower", None, ".2f"),
    ], 300, 150, about="transformer_bench.tf_split_workload"),
    *[_mesh(n) for n in (8, 16, 32)],
    Workload("small_calls_1", 2, lambda q: functools.partial(
        small_calls_bench.small_calls_workload, peers=1, calls=3000, quick=q), [
        Row("small_1_calls_per_s", "small calls, 32 in flight, 1 peer", "calls/s", "higher",
            "ratio>=1.2", ".0f"),
        Row("small_1_cpu_us_per_call", "small calls, 1 peer: CPU (all processes) per call", "us",
            "lower", "ratio<=0.5", ".0f"),
    ], 300, 150, about="small_calls_bench.small_calls_workload"),
    Workload("small_calls_3", 4, lambda q: functools.partial(
        small_calls_bench.small_calls_workload, peers=3, calls=4000, quick=q), [
        Row("small_3_calls_per_s", "small calls, 32 in flight per peer, 3 peers", "calls/s",
            "higher", "ratio>=1.2", ".0f"),
        Row("small_3_cpu_us_per_call", "small calls, 3 peers: CPU (all processes) per call", "us",
            "lower", "ratio<=0.5", ".0f"),
    ], 300, 150, about="small_calls_bench.small_calls_workload"),
    Workload("idle", 2, lambda q: _rpc(q, parts=("idle",)), [
        Row("idle_cpu_worker1_pct", "idle worker CPU (callee)", "% core", "lower", "distgrad<=1"),
        Row("idle_cpu_worker0_pct", "idle worker CPU (rank 0)", "% core", "lower", "distgrad<=1"),
    ], 120, 90, about="rpc_bench.measure_idle_cpu"),
]

BY_NAME = {w.name: w for w in WORKLOADS}
