"""PoC (second audit): transport/strength.py secret_bits (characters, words, LZ77
repetition) after the fix.

1. False positives (a warning on a good secret): 3,000 draws each of
   secrets.token_hex(16), token_hex(32), token_urlsafe(32), os.urandom(32),
   os.urandom(16) (exactly 128 bits: a warning there is expected now and then).
   FAIL if any of token_hex(32), token_urlsafe(32), urandom(32) ever warns, or
   token_hex(16) warns in more than 1%.
2. False negatives a guesser tries first (no warning = FAIL): the alphabet and
   keyboard rows in order, digits of pi, counting 1..60, a famous pangram, the
   base64 of 'password'*3, sha256('password') in hex (inherent: reported, not failed).
3. Odd input: 64 KiB and 1 MiB of 'a-' (separators recurring: word_bits's
   seps.count is quadratic), 64 KiB crafted for the LZ parse, lone surrogate bytes,
   NUL, invalid UTF-8. FAIL if one raises or takes over 5 s.
Run: cd /work/wt-audit35b && PYTHONPATH=$PWD DISTGRAD_PURE=1 timeout 600 python audits/issue35/poc_strength_second_look.py
"""
from __future__ import annotations

import base64
import hashlib
import multiprocessing as mp
import os
import secrets
import sys
import time

from distgrad.transport.strength import secret_bits


def timed(b: bytes, q):
    t = time.monotonic()
    try:
        v = secret_bits(b)
        q.put(("ok", v, time.monotonic() - t))
    except Exception as e:  # noqa: BLE001
        q.put(("raised", f"{type(e).__name__}: {e}", time.monotonic() - t))


def run_limited(b: bytes, limit=20.0):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=timed, args=(b, q))
    p.start()
    p.join(limit)
    if p.is_alive():
        p.kill()
        p.join()
        return ("timeout", None, limit)
    return q.get()


def main():
    bad = []
    gens = {"token_hex(16)": lambda: secrets.token_hex(16).encode(),
            "token_hex(32)": lambda: secrets.token_hex(32).encode(),
            "token_urlsafe(32)": lambda: secrets.token_urlsafe(32).encode(),
            "urandom(32)": lambda: os.urandom(32),
            "urandom(16)": lambda: os.urandom(16)}
    for name, g in gens.items():
        n, low, worst = 3000, 0, 1e9
        for _ in range(n):
            b = secret_bits(g())
            worst = min(worst, b)
            low += b < 128
        strict = name in ("token_hex(32)", "token_urlsafe(32)", "urandom(32)")
        fail = (strict and low) or (name == "token_hex(16)" and low > n // 100)
        print(f"  false positives {name}: {low}/{n} warned (lowest {worst:.0f} bits) -> "
              f"{'FAIL' if fail else 'holds'}")
        if fail:
            bad.append(name)
    pi = ("3141592653589793238462643383279502884197169399375105820974944592"
          "307816406286208998628034825342117067982148086513282306647093844609")
    weak = {"alphabet+ALPHABET+digits": string_all(),
            "keyboard rows x2 cases": "qwertyuiopasdfghjklzxcvbnmQWERTYUIOPASDFGHJKLZXCVBNM1234567890",
            "pi, 130 digits": pi,
            "counting 1..60": "".join(map(str, range(1, 61))),
            "pangram (inherent)": "the quick brown fox jumps over the lazy dog",
            "base64(password*3) (inherent)": base64.b64encode(b"password" * 3).decode(),
            "sha256('password') hex (inherent)": hashlib.sha256(b"password").hexdigest()}
    for name, s in weak.items():
        b = secret_bits(s.encode())
        fail = b >= 128 and "inherent" not in name
        print(f"  false negative? {name}: {b:.0f} bits -> "
              f"{'FAIL (no warning)' if fail else 'holds (warned)' if b < 128 else 'no warning (inherent)'}")
        if fail:
            bad.append(name)
    odd = {"'a-'*32768 (64 KiB)": b"a-" * 32768,
           "'a-b_'*16384": b"a-b_" * 16384,
           "'a-'*524288 (1 MiB)": b"a-" * 524288,
           "64 KiB urandom hex": os.urandom(32768).hex().encode(),
           "64 KiB LZ crafted (ab*k + c)": b"".join(b"ab" * k + b"c" for k in range(1, 256))[:65536],
           "lone surrogate bytes": b"\xed\xa0\x80" * 10 + os.urandom(32),
           "NUL x 64": b"\0" * 64,
           "invalid utf-8 1 MiB": b"\xff\xfe" * 524288}
    for name, b in odd.items():
        st, v, dt = run_limited(b)
        fail = st != "ok" or dt > 5
        print(f"  odd input {name}: {st} {v if st != 'ok' else round(v)} in {dt:.2f} s -> "
              f"{'FAIL' if fail else 'holds'}", flush=True)
        if fail:
            bad.append(name)
    print("FAIL: " + ", ".join(bad) if bad else "PASS")
    return 1 if bad else 0


def string_all():
    import string
    return string.ascii_lowercase + string.ascii_uppercase + string.digits


if __name__ == "__main__":
    sys.exit(main())
