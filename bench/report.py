"""Turn the per-run records of ``bench/run_all.py`` into one table.

A record is ``{"workload", "impl", "repeat" (1-based), "ok", "result" | "error",
"wall_s"}``. Each row's value for an implementation is the median over that
implementation's successful repeats; the ratio is distgrad / torch of those
medians; a target (see workloads.Row) is checked against the ratio or
distgrad's value.
"""
from __future__ import annotations

import math
import operator
import statistics

BASE, CAND = "torch", "distgrad"
_OPS = {"<=": operator.le, ">=": operator.ge}


def _num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def medians(records, workload, impl, key):
    """(median, values) of ``key`` over the successful runs of workload/impl."""
    vals = [r["result"][key] for r in records
            if r["workload"] == workload and r["impl"] == impl and r["ok"]
            and _num(r["result"].get(key))]
    return (statistics.median(vals) if vals else None), vals


def parse_target(target):
    """'ratio<=1' -> ('ratio', '<=', 1.0)."""
    for op in _OPS:
        if op in target:
            subject, thr = target.split(op)
            return subject.strip(), op, float(thr)
    raise ValueError(f"bad target {target!r}")


def check(target, ratio, cand):
    """'yes' / 'no', or '-' when the figure the target needs is missing."""
    if not target:
        return "-"
    subject, op, thr = parse_target(target)
    value = ratio if subject == "ratio" else cand
    if value is None:
        return "-"
    return "yes" if _OPS[op](value, thr) else "no"


def target_text(target):
    if not target:
        return ""
    subject, op, thr = parse_target(target)
    sym = {"<=": "≤", ">=": "≥"}[op]
    return f"{sym} {thr:.2f}x" if subject == "ratio" else f"{subject} {sym} {thr:g}"


def build_rows(workloads, records, impls):
    rows = []
    for w in workloads:
        for row in w.rows:
            vals = {i: medians(records, w.name, i, row.key) for i in impls}
            b, c = (vals.get(BASE) or (None,))[0], (vals.get(CAND) or (None,))[0]
            ratio = c / b if _num(b) and _num(c) and b else None
            rows.append({
                "workload": w.name, "key": row.key, "metric": row.label, "unit": row.unit,
                "better": row.better, "fmt": row.fmt,
                "values": {i: vals[i][0] for i in impls},
                "repeats": {i: vals[i][1] for i in impls},
                "ratio": ratio, "target": row.target,
                "met": check(row.target, ratio, c),
                "spread": spread(vals.get(CAND)),
            })
    return rows


def spread(vals):
    """The candidate's slowest repeat over its fastest (max / min of the repeats'
    values, >= 1; issue 45 asks <= 1.3x on every workload), or None with fewer
    than two values."""
    got = [v for v in ((vals or (None, ()))[1] or ()) if _num(v) and v > 0]
    return max(got) / min(got) if len(got) >= 2 else None


def json_safe(obj):
    """NaN/inf -> None, recursively, so results.json is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def _fmt(v, fmt):
    return "-" if v is None else format(v, fmt)


def _cell(row, impl, repeats):
    """The median, with '(k/n)' when only k of the n repeats gave a value."""
    v, got = row["values"].get(impl), len(row["repeats"].get(impl) or ())
    text = _fmt(v, row["fmt"])
    return text if v is None or got >= repeats else f"{text} ({got}/{repeats})"


def markdown(rows, impls, meta, errors):
    cols = list(dict.fromkeys([BASE, CAND] + list(impls)))
    out = [f"# distgrad vs torch.distributed.rpc ({meta['mode']}, "
           f"median of {meta['repeats']} repeat(s))", "",
           f"{meta['date']}; {meta['cpus']} CPUs; torch {meta['torch']}; "
           f"distgrad {meta['commit']} ({meta.get('message_path', '?')} message path); "
           f"loadavg before {meta['loadavg_before']}, "
           f"after {meta.get('loadavg_after')}; {meta.get('wall_s', 0):.0f} s"
           + (f"; INTERRUPTED ({meta['interrupted']})" if meta.get("interrupted") else "")
           + (f"; leaked workers killed: {meta['leaked_workers']}"
              if meta.get("leaked_workers") else "") + ".", "",
           "| workload | metric | " + " | ".join(cols) + " | ratio | target | met? | "
           f"{CAND} max/min |",
           "|---|---|" + "---:|" * len(cols) + "---:|---|---|---:|"]
    for r in rows:
        vals = [_cell(r, i, meta["repeats"]) for i in cols]
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        out.append(f"| {r['workload']} | {r['metric']} [{r['unit']}] ({r['better']} better) | "
                   + " | ".join(vals) + f" | {ratio} | {target_text(r['target'])} | {r['met']} | "
                   + ("-" if r.get("spread") is None else f"{r['spread']:.2f}x") + " |")
    out += ["", "ratio = distgrad / torch (medians of the repeats, same run); "
            "'(k/n)': only k of n repeats succeeded; max/min: the slowest of distgrad's "
            "repeats over its fastest (for a higher-better figure, the largest over the smallest)."]
    if errors:
        out += ["", "## Failures", ""]
        for e in errors:
            last = [ln for ln in e["error"].splitlines() if ln.strip()]
            out.append(f"- {e['workload']} / {e['impl']} (repeat {e['repeat']}): "
                       f"{last[-1] if last else e['error']}")
    return "\n".join(out) + "\n"
