#!/usr/bin/env python
"""Offline guessing against one sealed store entry (issue 35): how many guesses
at the cluster secret per second does one core test, given an entry read from
the rendezvous store?

    python bench/store_guessing.py [--seconds 10]

A worker's entry is sealed as distgrad seals it (``StoreSeal``) under a
passphrase of four words from the small list below, joined by ``-``. The
attacker walks every four-word phrase of the list, derives the store key as
the imported distgrad does (``sealed.store_key``: whatever it costs, scrypt
included) and checks the entry's tag, for ``--seconds`` or until it finds the
secret. Run it with the distgrad to measure on ``PYTHONPATH`` (a checkout of an
older commit measures the older derivation with the same words and the same
walk). Prints the rate, whether the secret was found, and the time the whole
walk takes at that rate.
"""
from __future__ import annotations

import argparse
import hmac
import itertools
import logging
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.environ.get("PYTHONPATH"):   # else the distgrad PYTHONPATH names is measured
    sys.path.insert(0, _ROOT)

WORDS = ("amber", "basket", "candle", "dolphin", "engine", "falcon", "garden", "harbor",
         "island", "jacket", "kettle", "lantern", "meadow", "needle", "orchard", "pepper",
         "quarry", "river", "saddle", "timber", "umbrella", "velvet", "walnut", "yellow")
SECRET = "timber-orchard-lantern-velvet"   # position ~60% of the walk's way
KEY = "distgrad/0.1/worker/1"


def main() -> None:
    """Seal one entry, then guess at its secret for ``--seconds``; print the rate."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    logging.disable(logging.WARNING)   # weak-secret warnings, one per guess
    import distgrad
    from distgrad.launch import sealed
    from distgrad.transport import handshake
    raw = sealed.StoreSeal(SECRET.encode(), "bench").seal(
        KEY, {"name": "worker1", "address": "tcp://10.0.0.2:41000"})
    head = len(sealed.MAGIC) + sealed.TAG_BYTES
    tag, body = raw[len(sealed.MAGIC):head], raw[head:]
    probe = sealed.StoreSeal(None, "bench")   # the attacker's: same attempt id ("0")
    tried, found = 0, None
    t0 = time.perf_counter()
    for words in itertools.product(WORDS, repeat=4):
        guess = "-".join(words).encode()
        probe._key = sealed.store_key(guess)
        getattr(handshake, "_stretched", {}).pop(guess, None)   # no memory of guesses
        tried += 1
        if hmac.compare_digest(probe._tag(KEY, body), tag):
            found = guess.decode()
            break
        if time.perf_counter() - t0 > args.seconds:
            break
    elapsed = time.perf_counter() - t0
    rate = tried / elapsed
    total = len(WORDS) ** 4
    print(f"distgrad from {os.path.dirname(distgrad.__file__)}")
    print(f"{tried} guesses in {elapsed:.2f} s: {rate:,.1f} guesses/s on one core; "
          f"secret {'FOUND: ' + found if found else 'not found'}")
    print(f"the whole walk ({len(WORDS)}^4 = {total:,} phrases) at this rate: "
          f"{total / rate:,.0f} s ({total / rate / 3600:,.2f} h)")


if __name__ == "__main__":
    main()
