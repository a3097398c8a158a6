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
import sys
import time
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


def _draws(seed: int, n: int, nbytes: int) -> list[bytes]:
    """``n`` random byte strings of ``nbytes`` from a seeded draw: what secrets.token_*
    would give, the same every run (a bound must not hold by a lucky draw)."""
    rnd = random.Random(seed)
    return [rnd.randbytes(nbytes) for _ in range(n)]


def test_secret_strength_counts_words_and_spares_random_secrets():
    from distgrad.transport.strength import secret_bits
    for phrase in (PASSPHRASE, "correct-horse-battery-staple-xyz", "CorrectHorseBatteryStaple2024!",
                   "correcthorsebatterystaple", "Sunshine-Rainbow-2024"):
        assert secret_bits(phrase.encode()) < 128, phrase
    # seeded draws (issue 42, item 8): over 20,000 draws of each the lowest were 256
    # (hex), 193 (urlsafe: a few runs read as words) and 128 (token_hex(16))
    for raw in _draws(42, 2000, 32):
        assert secret_bits(raw.hex().encode()) >= 256                       # token_hex(32)
        assert secret_bits(base64.urlsafe_b64encode(raw).rstrip(b"=")) >= 160   # token_urlsafe(32)
        assert secret_bits(raw[:16].hex().encode()) >= 128                  # token_hex(16)
    assert all(secret_bits(raw) == 256 for raw in _draws(43, 200, 32))    # os.urandom(32)


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


# -- issue 42, item 6 ---------------------------------------------------------------
TOKEN_42 = b"e26f50983990e195909119904523568d"   # a secrets.token_hex(16) once scored 126.5


def test_hex_counts_four_bits_a_character_and_no_token_hex_16_warns():
    """Hex was counted as 36 symbols a character: a 26-hex-digit token (104 bits) passed
    unwarned, while a true token_hex(16) was once scored 126.5 and every worker warned.
    Hex is 4 bits a character: every token_hex(16) of 5,000 seeded draws scores 128 (a
    chance match with the known sequences is never taken: see the next test), every
    26-digit one 104, and token_hex(32) 256."""
    from distgrad.transport.strength import secret_bits
    assert secret_bits(TOKEN_42) == 128.0
    assert secret_bits(TOKEN_42.upper()) == 128.0
    tokens = _draws(420, 5000, 16)
    low16 = min(secret_bits(t.hex().encode()) for t in tokens)
    low16_upper = min(secret_bits(t.hex().upper().encode()) for t in tokens[:1000])
    assert low16 == low16_upper == 128.0, (low16, low16_upper)
    short = [secret_bits(t.hex()[:26].encode()) for t in tokens[:1000]]
    assert max(short) <= 104.0 and min(short) > 100, (min(short), max(short))   # and warns
    assert min(secret_bits(t.hex().encode()) for t in _draws(421, 1000, 32)) == 256.0


def test_chance_matches_in_random_tokens_stay_far_below_the_margin(monkeypatch):
    """The margin a named stretch must save (strength._MARGIN, 20 bits) against what
    chance matches in random tokens save, measured on seeded draws: with the margin
    lowered to 8 bits, 32 to 64 hex digits or 40 decimal ones are marked down rarely
    (some 1 to 3 in 1,000) and never by more than 16 bits (the largest over 20,000
    draws each: 11.2, 15.0 and 12.7), so 20 leaves a margin of some 5 bits: 32 times
    rarer than the rarest chance match seen."""
    from distgrad.transport import strength
    monkeypatch.setattr(strength, "_MARGIN", 8.0)
    rnd = random.Random(422)
    cases = {"hex16": [t.hex() for t in _draws(423, 3000, 16)],
             "hex32": [t.hex() for t in _draws(424, 3000, 32)],
             "digits40": ["".join(rnd.choice(string.digits) for _ in range(40)) for _ in range(3000)]}
    for name, tokens in cases.items():
        down = [strength.char_bits(t) - strength.secret_bits(t.encode()) for t in tokens]
        down = [d for d in down if d > 1e-9]
        assert len(down) < 0.01 * len(tokens) and max(down, default=0) < 16, (name, sorted(down))


# secrets a guesser tries first, each counted as its characters, or far above what
# it costs to name, before issue 42 (old count, in bits: all but two drew no warning)
KNOWN_WEAK = [
    "zaq1xsw2cde3vfr4bgt5nhy6mju7ki8lo9",                 # columns, bottom up (176)
    "!QAZ@WSX#EDC$RFV%TGB^YHN",                           # columns, shifted (141)
    "1q2w3e4r5t6y7u8i9o0p!Q@W#E$R%T",                     # the zigzag, then shifted (197)
    "19992000200120022003200420052006200720082009",       # years in a row (146)
    "2024 2023 2022 2021 2020 2019 2018 2017 2016 2015",  # backwards, spaced (266)
    "2468101214161820222426283032343638404244",           # even numbers (133)
    "510152025303540455055606570758085",                  # fives (110: its characters)
    "0102030405060708091011121314151617181920",           # zero-padded counting (75)
    "2024-01-012024-01-022024-01-032024-01-042024-01-05",  # days in a row (149)
    "05/01/2024 06/01/2024 07/01/2024 08/01/2024 09/01/2024",   # (155)
    "31.12.1999/01.01.2000/02.01.2000/03.01.2000",        # across a year's end (170)
]


@pytest.mark.parametrize("secret", KNOWN_WEAK)
def test_keyboard_columns_years_dates_and_arithmetic_runs_are_known(secret):
    from distgrad.transport.strength import char_bits, secret_bits
    bits = secret_bits(secret.encode())
    assert bits < 48 and bits < char_bits(secret) / 2.5, (secret, bits)


def test_the_issues_short_examples_cost_what_naming_them_costs():
    """The issue's own examples (under 128 bits by their characters already) are read as
    what they are: a walk, a run: some 30 bits at most, not their characters' 43 to 108."""
    from distgrad.transport.strength import secret_bits
    for secret in (b"1qaz2wsx3edc", b"qazwsxedc", b"19992000200120022003", b"2024-01-012024-01-02",
                   b"2468101214161820", b"5101520253035"):
        assert secret_bits(secret) < 34, (secret, secret_bits(secret))


def _calls(fn, *args) -> int:
    """How many Python and built-in calls ``fn(*args)`` makes: a count of work that a
    busy machine does not change (where a timer would)."""
    count = [0]

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            count[0] += 1
    sys.setprofile(profile)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return count[0]


def test_a_long_secret_costs_a_bounded_estimate():
    """A 64 Ki-character secret took 2-10 s on a loaded machine: the parse read every
    character (13 times the calls of a 4 Ki one). Now its work is bounded: a 64 Ki one
    costs less than 3 times a 4 Ki one (counted in calls, not seconds) and well
    under a second, as does 1 MiB; long repetitions are still seen whole."""
    from distgrad.transport.strength import secret_bits
    rnd = random.Random(424)
    make = {"printable": lambda n: "".join(rnd.choice(string.printable[:94]) for _ in range(n)),
            "digits": lambda n: "".join(rnd.choice(string.digits) for _ in range(n)),
            "two letters": lambda n: "".join(rnd.choice("ab") for _ in range(n))}
    for name, gen in make.items():
        small, large = gen(4096).encode(), gen(65536).encode()
        c_small, c_large = _calls(secret_bits, small), _calls(secret_bits, large)
        assert c_large < 3 * c_small, (name, c_small, c_large)
        t = time.process_time()
        assert secret_bits(large) > 4096 and secret_bits(large * 16) > 4096   # 1 MiB
        assert time.process_time() - t < 2.0, name
    assert secret_bits(b"x" * (1 << 20)) < 128 and secret_bits(b"a-b_" * (1 << 18)) < 128


def test_stretch_estimates_the_secret_once(monkeypatch, caplog):
    """stretch() estimated a weak secret twice (the test and the message)."""
    from distgrad.transport import handshake
    calls = []

    def counted(secret):
        calls.append(secret)
        return 40.0
    monkeypatch.setattr(handshake, "secret_bits", counted)
    secret = b"a weak secret for issue 42 " + os.urandom(8).hex().encode()   # (not stretched yet)
    with caplog.at_level("WARNING", logger="distgrad.transport.handshake"):
        handshake.stretch(secret)
    assert len(calls) == 1, calls
    assert "some 40 bits" in caplog.text, caplog.text


def test_hex_in_a_wrapper_counts_four_bits_a_digit():
    """Issue 42's second audit: hex digits inside a common wrapper (a uuid's dashes, a
    0x prefix, dashes every few digits) counted as text, some 200 bits, so 104- and
    112-bit tokens drew no warning. The digits count 4 bits each, the wrapper none."""
    import random
    import uuid

    from distgrad.transport.handshake import secret_bits
    rnd = random.Random(5)
    for _ in range(200):
        u = str(uuid.UUID(int=rnd.getrandbits(128), version=4))
        assert 100 <= secret_bits(u.encode()) <= 128, u          # 122 random bits
        h14 = rnd.randbytes(14).hex()
        if not h14.isdigit() and not h14.isalpha():
            assert secret_bits(("0x" + h14).encode()) == 112.0
        h13 = rnd.randbytes(13).hex()
        dashed = "-".join(h13[i:i + 4] for i in range(0, 26, 4))
        if not h13.isdigit() and not h13.isalpha():
            assert secret_bits(dashed.encode()) == 104.0
