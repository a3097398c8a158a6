"""PoC: the weak-secret estimate (transport/strength.py secret_bits) on secrets
a guesser finds at once, and on odd input.

A false negative is a secret that draws no warning (>= 128 bits) although a
guesser enumerates it quickly: repetitions of one character or one word,
non-English (non-ASCII) dictionary words, English words with five consonants
in a row, non-UTF-8 repeated bytes. Odd input: empty, non-UTF-8 bytes in the
environment (surrogate-escaped by Python) read by secret_from_env() and by
`distgrad launch`.
FAIL lists each false negative and each crash.
Run: PYTHONPATH=/work/wt-audit35 DISTGRAD_PURE=1 timeout 60 python audit/poc_weak_secret_estimator.py
"""
from __future__ import annotations

import os
import subprocess
import sys

from distgrad.transport.strength import secret_bits

WEAK = {
    "one letter x64": b"a" * 64,
    "one digit x64 (looks like a hex token's length)": b"0" * 64,
    "'password' x8": b"password" * 8,
    "'Summer2024!' x3": b"Summer2024!" * 3,
    "four Cyrillic dictionary words": "пароль-солнце-машина-собака-здравствуйте".encode(),
    "four German words with umlauts": "Grüße-Bäckerei-Fußball-Öffnungszeiten".encode(),
    "English words with 5+ consonant runs": b"strengths-twelfths-angsts-lengths",
    "one byte 0xff x20 (not UTF-8)": b"\xff" * 20,
    "keyboard walk x3": b"qwertyuiop1234567890" * 3,
    "NUL byte x40": b"\0" * 40,
}
bad = []
for name, s in WEAK.items():
    bits = secret_bits(s)
    flag = "FAIL (no warning)" if bits >= 128 else "holds (warned)"
    if bits >= 128:
        bad.append(name)
    print(f"  {flag}: {name}: {bits:.0f} bits")

for name, s in {"empty": b"", "1 MiB": os.urandom(1 << 20)}.items():
    try:
        print(f"  holds: {name}: {secret_bits(s):.0f} bits, no crash")
    except Exception as e:  # noqa: BLE001
        bad.append(f"crash on {name}")
        print(f"  FAIL: {name}: {type(e).__name__}: {e}")

# a secret with a byte that is not UTF-8 in the environment (Python: surrogateescape)
code = ("from distgrad.transport.auth import secret_from_env; s = secret_from_env(); "
        "print('read', len(s))")
env = {k: v for k, v in os.environ.items()}
env_b = {k.encode(): v.encode() for k, v in env.items()}
env_b[b"DISTGRAD_SECRET"] = b"\xff" * 40 + b"abc"
r = subprocess.run([sys.executable, "-c", code], env=env_b, capture_output=True, text=True,
                   timeout=60)
if r.returncode != 0:
    last = r.stderr.strip().splitlines()[-1]
    bad.append("secret_from_env crashes on a non-UTF-8 secret")
    print(f"  FAIL: secret_from_env() with a non-UTF-8 DISTGRAD_SECRET: {last}")
else:
    print(f"  holds: secret_from_env() with a non-UTF-8 DISTGRAD_SECRET: {r.stdout.strip()}")
print("FAIL: " + "; ".join(bad) if bad else "PASS")
sys.exit(1 if bad else 0)
