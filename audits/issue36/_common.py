"""Shared by the audit programs: strict JSON + trace-event checks, and the worker runner."""
import json, os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))  # the repository's tests/
from mp_utils import run_workers  # noqa: E402,F401


def strict_load(path):
    def bad(name):
        raise ValueError(f"not JSON: {name}")
    with open(path) as f:
        return json.load(f, parse_constant=bad)


def perfetto_problems(doc):
    """What a trace-event reader (Perfetto's JSON importer) needs that is not there."""
    probs = []
    if not isinstance(doc.get("traceEvents"), list):
        return ["no traceEvents list"]
    flows = {}
    named = set()
    for i, e in enumerate(doc["traceEvents"]):
        ph = e.get("ph")
        if ph not in ("X", "M", "i", "s", "f", "B", "E", "C"):
            probs.append(f"#{i} ph {ph!r}")
        for k in ("pid", "tid", "name"):
            if k not in e:
                probs.append(f"#{i} ({ph} {e.get('name')}) no {k}")
        if not isinstance(e.get("pid"), int) or not isinstance(e.get("tid"), int):
            probs.append(f"#{i} pid/tid not int: {e.get('pid')!r} {e.get('tid')!r}")
        if ph != "M" and not isinstance(e.get("ts"), (int, float)):
            probs.append(f"#{i} ({ph} {e.get('name')}) ts {e.get('ts')!r}")
        if ph == "X" and (not isinstance(e.get("dur"), (int, float)) or e["dur"] < 0):
            probs.append(f"#{i} X {e.get('name')} dur {e.get('dur')!r}")
        if ph in ("s", "f"):
            if "id" not in e or "cat" not in e:
                probs.append(f"#{i} flow without id/cat")
            flows.setdefault(e.get("id"), []).append(ph)
        if ph == "M" and e.get("name") == "process_name":
            named.add(e["pid"])
        if ph != "M" and isinstance(e.get("ts"), (int, float)) and e["ts"] < 0:
            probs.append(f"#{i} ({ph} {e.get('name')}) negative ts {e['ts']}")
    for fid, phs in flows.items():
        if sorted(phs) != ["f", "s"]:
            probs.append(f"flow {fid}: {phs}")
    pids = {e.get("pid") for e in doc["traceEvents"] if e.get("ph") != "M"}
    for p in pids - named:
        probs.append(f"pid {p} has no process_name")
    return probs
