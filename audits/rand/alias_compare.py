import json, os
d = os.path.dirname(os.path.abspath(__file__))
L, T, D = (json.load(open(f"{d}/alias_{n}.json")) for n in ("local", "torch", "distgrad"))
for k in sorted(T):
    l, t, g = L[k], T[k], D[k]
    flags = []
    if "error" in t or "error" in g:
        flags.append(f"ERR torch={t.get('error')} distgrad={g.get('error')}")
    else:
        if t["after"] != l["after"]: flags.append("TORCH!=LOCAL")
        if g["after"] != t["after"]: flags.append("DISTGRAD!=TORCH")
    print(f"{k:45s} local.changed={l['changed']!s:5} torch.changed={t.get('changed')!s:5} "
          f"distgrad.changed={g.get('changed')!s:5} {' '.join(flags)}")
