"""Hand-made random-programs programs run through the harness's own check_program
(clean reference vs distgrad cluster): a ("keep", ...) hook inside a call block on a
view of a param; the kept gradient's view is the caller's leaf's gradient in the
local reference (a call is a function call there) but crosses a message in the
distributed run (torch copies it: see alias_check)."""
import json, os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", ".."))


def prog(seed, callee, op, keep_op="mul"):
    # worker0: leaf 1 (2,3); call worker `callee`: r2 = op(r1); keep r2; r4 = dot(r2); return r4
    attrs = {"shape": [6]} if op == "reshape" else {"dim": 0}
    shape = [6] if op == "reshape" else [1, 2, 3]
    body = [["op", 2, op, [1], attrs], ["keep", 2, {"op": keep_op}],
            ["op", 4, "dot", [2], {"w": "s%d.w" % seed}]]
    return {"seed": seed, "world": 2, "retain": False, "roots": [3],
            "main": {"worker": 0, "params": [], "body": [
                ["leaf", 1, f"s{seed}.w0.leaf1", [2, 3], True],
                ["call", [3], "sync", {"worker": callee, "params": [1], "body": body, "returns": [4]}]],
                "returns": [3]}}


PROGS = [prog(1, 1, "reshape"), prog(2, 0, "reshape"), prog(3, 1, "unsqueeze"), prog(4, 0, "unsqueeze"),
         prog(5, 1, "reshape", "add"), prog(6, 1, "reshape", "zero")]


def body(rank, world, progs):
    if rank != 0:
        return None
    import random_programs as rp
    out = []
    for p in progs:
        rec = rp.check_program(p)
        out.append({k: rec.get(k) for k in ("seed", "ok", "group", "detail")})
    return out


if __name__ == "__main__":
    from mp_utils import run_workers
    res = run_workers(body, world_size=2, timeout=240, args=(PROGS,))
    for r in res[0]:
        print(json.dumps(r))
