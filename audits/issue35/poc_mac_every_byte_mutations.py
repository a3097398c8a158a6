"""PoC (unit, real Authenticator): mutations of a sealed every-byte message on TCP.

Each case seals a message with Authenticator.seal(every=True) and gives the
receiver a mutated copy: a byte moved between frames (lengths kept in total),
two equal-length tensor frames swapped, a frame dropped / added / truncated,
an empty tensor, the last partial 16-byte block below and above 64 KiB, the
envelope/tensor boundary moved, the 'full' count changed, the _ALL flag
stripped, seq replay, and a one-time-key check (two messages never share a
Poly1305 key). Each mutation must raise AuthError; the gap case shows the
deletion defect at unit level (seq 3 accepted after seq 1).
Run: PYTHONPATH=/work/wt-audit35 DISTGRAD_PURE=1 timeout 60 python audit/poc_mac_every_byte_mutations.py
"""
from __future__ import annotations

import hashlib
import os
import struct
import sys

from distgrad.transport.auth import Authenticator, AuthError

fails = []


def pair():
    a, b = Authenticator(b"k" * 32, 0), Authenticator(b"k" * 32, 1)
    a.set_peer_nonce(1, b.nonce)
    b.set_peer_nonce(0, a.nonce)
    return a, b


def refused(name, frames_fn, msg=None):
    a, b = pair()
    msg = msg or [b"envelope-bytes", os.urandom(70000), os.urandom(70000), b""]
    sealed = a.seal(1, [bytes(f) for f in msg], 1, True)
    mutated = frames_fn([bytes(f) for f in sealed])
    try:
        b.open(0, mutated, every=True)
    except AuthError as e:
        print(f"  holds: {name}: refused ({e})")
        return
    fails.append(name)
    print(f"  FAIL: {name}: accepted")


def move_byte(fr):   # first byte of tensor 2 moved to the end of tensor 1
    fr[2] = fr[2] + fr[3][:1]
    fr[3] = fr[3][1:]
    return fr


refused("byte moved between two tensor frames", move_byte)
refused("equal-length tensor frames swapped", lambda fr: [fr[0], fr[1], fr[3], fr[2], fr[4]])
refused("last frame dropped", lambda fr: fr[:-1])
refused("frame added", lambda fr: fr + [b"x"])
refused("empty frame given a byte", lambda fr: fr[:-1] + [b"\0"])
refused("last tensor truncated by 1", lambda fr: fr[:3] + [fr[3][:-1]] + fr[4:])
refused("envelope/tensor boundary moved",
        lambda fr: [fr[0], fr[1] + fr[2][:1], fr[2][1:], fr[3], fr[4]])


def set_full(n):
    def f(fr):
        seq, full = struct.unpack("!QI", fr[0][:12])
        fr[0] = struct.pack("!QI", seq, n) + fr[0][12:]
        return fr
    return f


refused("'full' changed to 0 (keeping _ALL)", set_full(0 | 0x80000000))
refused("_ALL flag stripped", set_full(1))
# below 64 KiB: BLAKE2b path, partial last block
refused("small message, last partial block changed",
        lambda fr: fr[:2] + [fr[2][:-1] + bytes([fr[2][-1] ^ 1])],
        msg=[b"env", os.urandom(65535 - 3)])
# just at 64 KiB: Poly1305 path, last partial 16-byte block changed
refused("Poly1305 path, last partial block changed",
        lambda fr: fr[:2] + [fr[2][:-1] + bytes([fr[2][-1] ^ 1])],
        msg=[b"env", os.urandom(65536 + 5)])
# Poly1305 pads a short final block with 0x01: a trailing zero byte appended must not collide
refused("Poly1305 path, trailing zero byte appended (length kept in sizes)",
        lambda fr: fr[:2] + [fr[2] + b"\0"], msg=[b"env", os.urandom(65536 + 5)])

# replay
a, b = pair()
m = a.seal(1, [b"e", os.urandom(70000)], 1, True)
b.open(0, list(m), every=True)
try:
    b.open(0, list(m), every=True)
    fails.append("replay")
    print("  FAIL: replay accepted")
except AuthError as e:
    print(f"  holds: replay refused ({e})")

# one-time keys: distinct per (direction key, seq); a reset of seq reuses them
a, b = pair()
keys = set()
for _ in range(1000):
    seq = a._send_seq.get(1, 0) + 1
    head = struct.pack("!QI", seq, 1 | 0x80000000)
    keys.add(hashlib.blake2b(head, key=a._send_keys[1][:32], digest_size=32,
                             person=b"dg-poly1305-otk").digest())
    a.seal(1, [b"e", bytes(70000)], 1, True)
print(f"  holds: 1000 messages, {len(keys)} distinct Poly1305 one-time keys" if len(keys) == 1000
      else "  FAIL: one-time key reused")

# deletion at unit level
a, b = pair()
m1, m2, m3 = (a.seal(1, [b"e%d" % i, bytes(10)], 1, True) for i in (1, 2, 3))
b.open(0, m1, every=True)
try:
    b.open(0, m3, every=True)
    fails.append("gap")
    print("  FAIL: message 2 deleted: message 3 accepted after message 1 (seq gap)")
except AuthError as e:
    print(f"  holds: gap refused ({e})")

print("FAIL:" if fails else "PASS", ", ".join(fails))
sys.exit(1 if fails else 0)
