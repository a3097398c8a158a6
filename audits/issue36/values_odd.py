"""Span details of odd types: plain() (what a span's __exit__ runs) must never raise
and must give strict JSON. Prints PASS/FAIL per value."""
import json, math, sys, time
import numpy as np, torch
from distgrad.trace.records import plain

class BadRepr:
    def __repr__(self): raise RuntimeError("repr boom")
    def __str__(self): raise RuntimeError("str boom")
class BadKey:
    def __hash__(self): return 1
    def __str__(self): raise RuntimeError("key str boom")
class BadItems(dict):
    def items(self): raise RuntimeError("items boom")
class BadLen(list):
    def __iter__(self): raise RuntimeError("iter boom")
rec = {}; rec["self"] = rec
lst = []; lst.append(lst)
cases = {
    "np.int64": np.int64(3), "np.float32nan": np.float32("nan"), "np.longdouble": np.longdouble(1.5),
    "np.datetime64": np.datetime64("2024-01-01"), "np.bool_": np.bool_(True), "np.complex": np.complex128(1+2j),
    "np.array0d": np.array(5), "np.bigarr": np.zeros((100, 3)), "np.object_arr": np.array([object()], dtype=object),
    "np.structured": np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]),
    "tensor": torch.ones(2), "tensor_nan": torch.tensor([float("nan"), float("inf")]),
    "tensor_big": torch.zeros(100, 3), "bf16": torch.ones(2, dtype=torch.bfloat16),
    "complex_t": torch.ones(2, dtype=torch.complex64), "bool_t": torch.tensor([True]),
    "meta_t": torch.empty(2, device="meta"), "sparse_t": torch.eye(2).to_sparse(),
    "sparse_csr": torch.eye(2).to_sparse_csr(),
    "quant_t": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8),
    "nested_t": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
    "requires_grad": torch.ones(2, requires_grad=True), "param": torch.nn.Parameter(torch.ones(2)),
    "dtype": torch.float32, "device": torch.device("cpu"), "size": torch.Size([2, 3]),
    "set": {1, 2}, "frozenset": frozenset({"a"}), "bytes": b"\x00\xff", "bytearray": bytearray(b"ab"),
    "memoryview": memoryview(b"ab"), "recursive_dict": rec, "recursive_list": lst,
    "bad_repr": BadRepr(), "bad_key": {BadKey(): 1}, "bad_items": BadItems(a=1),
    "bad_iter": BadLen([1]), "inf": float("inf"), "huge_int": 10**400, "neg_huge": -(2**70),
    "float_sub_nan": type("F", (float,), {})(float("nan")), "module": torch, "func": len,
    "cls": int, "none_key": {None: 1, 1.5: 2, (1, 2): 3}, "slice": slice(1, 2), "ellipsis": ...,
    "range": range(10**9), "gen": (i for i in range(3)), "big_list": list(range(10**6)),
    "complex": 1+2j, "Decimal": __import__("decimal").Decimal("NaN"),
}
bad = 0
for name, v in cases.items():
    t0 = time.perf_counter()
    try:
        out = plain({"v": v})
        s = json.dumps(out, allow_nan=False)
        json.loads(s)
        dt = time.perf_counter() - t0
        ok = dt < 0.5
        print(f"{'PASS' if ok else 'FAIL'} {name}: {s[:90]} ({dt*1e3:.1f} ms)")
        bad += not ok
    except Exception as e:
        bad += 1
        print(f"FAIL {name}: {type(e).__name__}: {e}")
print("summary:", "PASS" if not bad else f"FAIL ({bad} values)")
