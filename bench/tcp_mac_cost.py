#!/usr/bin/env python
"""What authenticating every byte on TCP costs per message (issue 35, item 5):
``Authenticator.seal`` + ``open`` of one message (a small envelope and one
tensor frame) with ``every=True`` (the TCP default: tensors by Poly1305 from 64
KiB) and without (tensors by length only: ``DISTGRAD_MAC_TENSORS=0``, and Unix
sockets), in one process, best of ``--repeats``.

    python bench/tcp_mac_cost.py [--repeats 7]

A round trip of an RPC seals and opens its payload twice (request and reply).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, _ROOT)

SIZES = {"16KB": 16 << 10, "256KB": 256 << 10, "16MB": 16 << 20, "128MB": 128 << 20}


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    """Print, per size, seal+open time with every byte and by length, and GB/s."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    from distgrad.transport.auth import Authenticator
    a, b = Authenticator(b"k" * 32, 0), Authenticator(b"k" * 32, 1)
    a.set_peer_nonce(1, b.nonce)
    b.set_peer_nonce(0, a.nonce)
    print(f"loadavg {os.getloadavg()}")
    print(f"{'size':>6} {'every byte':>12} {'by length':>12} {'MAC GB/s':>9}")
    for label, n in SIZES.items():
        frames = [os.urandom(200), memoryview(bytearray(n))]
        every = _best(lambda f=frames: b.open(0, a.seal(1, list(f), 1, True), every=True),
                      args.repeats)
        length = _best(lambda f=frames: b.open(0, a.seal(1, list(f), 1)), args.repeats)
        rate = 2 * n / max(every - length, 1e-9) / 1e9   # seal and open each read n bytes
        print(f"{label:>6} {every * 1e3:>10.3f}ms {length * 1e3:>10.3f}ms {rate:>9.2f}")


if __name__ == "__main__":
    main()
