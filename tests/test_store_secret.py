"""Whoever reads the rendezvous store must pay a scrypt per guess at the secret
(issue 35, item 1).

Real workers (spawn) start a static group on a store the test hosts as torchrun's
agent does, with a passphrase of four dictionary words as the secret. The test
then reads their sealed entries as anyone who reaches the store's port can: each
entry's tag checks only under a key derived from the secret *stretched by scrypt*
(derived here independently of distgrad's code), never under a key derived from
the raw secret, so a guess tested against an entry costs a scrypt. The workers
also warned that the passphrase is weak: words count as words, not as characters.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import os
import random
import statistics
import string
import struct
from datetime import timedelta

import pytest
import torch.distributed as dist
from mp_utils import free_port, run_workers

pytestmark = pytest.mark.timeout(120)

PASSPHRASE = "timber-orchard-lantern-velvet-maple"   # 35 characters, five common words


def _hkdf(secret: bytes, info: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def _scrypt(secret: bytes) -> bytes:
    """scrypt as docs/threat-model.md states it: n=2**14, r=8, p=1, 32 bytes."""
    return hashlib.scrypt(secret, salt=b"distgrad-secret-v2", n=2 ** 14, r=8, p=1, dklen=32,
                          maxmem=64 << 20)


def _tag(key: bytes, attempt: str, name: str, body: bytes) -> bytes:
    framed = b"".join(struct.pack("!I", len(p)) + p for p in (attempt.encode(), name.encode(), body))
    return hmac.new(key, framed, hashlib.sha256).digest()


def _start(rank: int, world_size: int, port: int) -> list[str]:
    import logging

    import torch

    import distgrad.rpc as rpc
    seen: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logging.getLogger("distgrad").addHandler(_Keep(level=logging.WARNING))
    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    rpc.init_rpc(f"worker{rank}")
    assert rpc.rpc_sync(f"worker{1 - rank}", torch.add, args=(torch.ones(1), 1)).item() == 2.0
    rpc.shutdown()
    return seen


def test_store_entries_cost_a_scrypt_per_guess_and_words_count_as_words():
    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, None, is_master=True, timeout=timedelta(seconds=60),
                         wait_for_workers=False, multi_tenant=True)
    warnings = run_workers(_start, world_size=2, init=False, timeout=90, args=(port,),
                           env_per_rank={r: {"DISTGRAD_SECRET": PASSPHRASE} for r in range(2)})
    secret = PASSPHRASE.encode()
    stretched, raw = _hkdf(_scrypt(secret), b"distgrad-store-v2"), _hkdf(secret, b"distgrad-store-v1")
    checked = 0
    for name in host.list_keys():
        value = host.get(name)
        if not value.startswith(b"DGS1"):
            continue
        tag, body = value[4:36], value[36:]
        assert tag != bytes(32), name
        assert tag != _tag(raw, "0", name, body), f"{name}: sealed under the raw secret"
        checked += tag == _tag(stretched, "0", name, body)
    assert checked >= 2, "no entry sealed (in attempt 0, under its own name) to check"
    for seen in warnings:
        weak = [w for w in seen if "weaker than 128 bits" in w]
        assert len(weak) == 1 and "secrets.token_hex(32)" in weak[0], seen


def test_secret_strength_counts_words_and_spares_random_secrets():
    from distgrad.transport.strength import secret_bits
    for phrase in (PASSPHRASE, "correct-horse-battery-staple-xyz", "CorrectHorseBatteryStaple2024!",
                   "correcthorsebatterystaple", "Sunshine-Rainbow-2024"):
        assert secret_bits(phrase.encode()) < 128, phrase
    # seeded draws, not fresh ones: a fresh token_hex(16) once drew e's digits 9045235
    # (e26f50983990e195909119904523568d: 126.5 bits, issue 42)
    rnd = random.Random(42)
    for _ in range(300):
        assert secret_bits(rnd.randbytes(32).hex().encode()) >= 256
        assert secret_bits(base64.urlsafe_b64encode(rnd.randbytes(32)).rstrip(b"=")) >= 160
        assert secret_bits(rnd.randbytes(16).hex().encode()) >= 128
    assert secret_bits(rnd.randbytes(32)) == 256


def test_secret_strength_sees_repetition_and_words_of_any_script():
    """Issue 35's audit: secrets a guesser finds at once drew no warning."""
    from distgrad.transport.strength import secret_bits
    weak = [b"a" * 64, b"0" * 64, b"password" * 8, b"Summer2024!" * 3, b"qwertyuiop1234567890" * 3,
            b"\0" * 40, b"\xff" * 20, b"x" * 60_000, b"strengths-twelfths-angsts-lengths",
            "пароль-солнце-машина-собака-здравствуйте".encode(),
            "Grüße-Bäckerei-Fußball-Öffnungszeiten".encode(),
            # what a guesser tries first (the second audit): sequences, rows, counting, pi
            (string.ascii_lowercase + string.ascii_uppercase + string.digits).encode(),
            b"qwertyuiopasdfghjklzxcvbnmQWERTYUIOPASDFGHJKLZXCVBNM1234567890",
            b"".join(b"%d" % i for i in range(1, 61)), b"3141592653589793238462643383279502884197",
            b"a-b_" * 16384]
    for secret in weak:
        assert secret_bits(secret) < 128, secret[:40]
    assert secret_bits(b"") == 0
    assert secret_bits(os.urandom(1 << 20)) > 8_000_000   # random: no repeats to take away
    # the copy is nearly free: a secret said twice costs about 20 bits more than once
    # (against ~320 for the token). Fixed tokens (a seeded draw), not fresh ones: over
    # fresh tokens the cost has a median of 19.9 bits and a tail (1.5 % above 20, up
    # to 31 in 3000 draws), which made a bound of 20 on one fresh token fail at random
    rnd = random.Random(35)
    costs = []
    for _ in range(64):
        token = bytes(rnd.getrandbits(8) for _ in range(32)).hex().encode()
        costs.append(secret_bits(token * 2) - secret_bits(token))
    assert statistics.median(costs) < 21 and max(costs) < 40, sorted(costs)
