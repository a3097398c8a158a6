"""A rough estimate of how many guesses a cluster secret resists.

Three ways to count, and the secret gets the smallest:

- as *characters*: its length times log2 of the size of the character classes
  it uses (lowercase, uppercase, digits, anything else). A secret of hex digits
  only (digits and a-f, as ``secrets.token_hex`` makes) counts exactly 4 bits a
  character (16 symbols; 22 where both cases of a-f appear), never the 36 of
  digits and all lowercase letters, so a 26-character hex token counts 104 bits
  and warns, and every ``token_hex(16)`` counts 128;
- as *words*: split into runs of letters (a capital starts a new run), digits
  and other characters. A run of three letters or more that reads like words
  (enough vowels, no cluster of six consonants; or, whatever its letters, one
  between separators that recur, as in a diceware phrase) costs a guesser one word of a large dictionary
  (:data:`WORD_BITS`) per :data:`WORD_LETTERS` letters, at least one, plus a bit
  when capitalised, or its characters if that is less. Every other character
  costs what it costs counted as characters, except a separator that appears
  again (``-`` between every word is one choice, not four). The word count applies
  only when such runs make up half the secret or more, and not to hex;
- as *what a guesser tries first*: read left to right, a stretch that repeats one
  before it (a unit said again, ``password`` * 8, a keyboard walk typed three
  times), or one of the sequences a guesser tries first, costs what it takes to
  name it, not its characters, as a compressor with a preset dictionary would
  count it (an LZ77 parse; bytes that are not UTF-8 too). The sequences: the
  alphabet, digits and keyboard rows and columns (``1qaz2wsx3edc``, ``qazwsxedc``,
  ``zaq1xsw2``, ``1q2w3e4r``) in order or backwards, counting, digits of pi and e
  (a back-reference into :data:`_KNOWN`: some 2 log2 n bits for where and how
  long); numbers in arithmetic progression, with or without a separator
  (``19992000200120022003``, ``2468101214161820``, ``5101520253035``,
  ``10 9 8 7``: the first number, the step and the count); dates, one or a run of
  them a fixed number of days or months apart (``2024-01-012024-01-02``,
  ``01.03.1999``: some 16 bits for a day of 1900-2099, the layout, the step and
  the count). A stretch is named only where that saves more than
  :data:`_MARGIN` bits: chance matches in a random secret (digits of pi inside a
  hex token) save less (the most seen in 20,000 seeded draws of 32 or 64 hex
  digits: 15 bits), so a random token is not marked down by chance (no
  ``token_hex(16)`` of those draws scores under 128).

Letters are Unicode letters: a run in another script (``пароль``, ``Grüße``)
counts as words without the vowel test, which knows English only.

The word count needs no dictionary: it errs towards calling a run words, which
at worst draws a warning for a secret that was fine. Random secrets are hardly
touched: few of their runs read as words, and a long random run of letters
that does is still counted at 2.8 bits a letter (a word of 17 bits per 6).

The work is bounded whatever the secret's length: the parse reads until it has
spent :data:`_WORK` steps (a few thousand characters of a random secret; a long
repetition is read in one step), and deflate, with what was read as its
dictionary, counts the rest; words are looked for in the first
:data:`_WORDS_LIMIT` characters. A 64 Ki-character secret costs some
milliseconds, a 1 MiB one well under a second.

Example::

    >>> secret_bits(b"correct-horse-battery-staple-xyz") < 128     # words, not 32 characters
    True
    >>> secret_bits(b"0f3a" * 16) < 64                              # a unit said 16 times
    True
    >>> secret_bits(b"e26f50983990e195909119904523568d")            # a token_hex(16)
    128.0
    >>> secret_bits(b"19992000200120022003") < 40                   # years in a row
    True
"""
from __future__ import annotations

import datetime
import math
import re
import string
import zlib
from collections import Counter

WORD_BITS = math.log2(100_000)   # a guesser's dictionary: some 100,000 words
WORD_LETTERS = 6                 # letters per word, rounded: a long run is several words
# letters (any script; a capital starts a new run), digits, everything else
_TOKENS = re.compile(r"[^\W\d_a-z]?[^\W\d_A-Z]+|[^\W\d_a-z]+(?![^\W\d_A-Z])|[0-9]+|[\W_]+")
_HEX = re.compile(r"[0-9a-fA-F]+")
# hex digits with separators (uuid4: 8-4-4-4-12 with dashes; colon pairs) or a 0x prefix
_WRAPPED_HEX = re.compile(r"(?:0[xX])?([0-9a-fA-F]+(?:[-:_. ][0-9a-fA-F]+)*)")
_CONSONANTS = re.compile(r"[^aeiouy]{6,}")   # ("strengths", "twelfths": five are words)
_MIN_MATCH = 4        # a repeat shorter than this is chance in a random secret
_CHAIN = 64           # earlier starts of a repeat tried (most recent first), as zlib bounds it
# Bits a named stretch must save to be taken. A chance match in a random secret
# saves about k bits with odds some 2^-k per position (the cost of naming it counts
# the places it could come from): the most seen in 20,000 seeded draws of 32 or 64
# hex digits is 15 bits, of 40 decimal ones 12.7 (tests/test_store_secret.py).
_MARGIN = 20.0
_WORK = 1 << 15       # steps the parse may take (4 a position, 1 a character indexed or
                      # a comparison, 24 a run of numbers or dates tried); deflate counts what is left
_WORDS_LIMIT = 4096   # characters the word count reads; the rest count as characters
_DEFLATE_LIMIT = 1 << 18   # characters deflate reads after the parse; the rest count as characters
_SEQ_BITS = 3.0       # which kind of stretch (a repeat, a run of numbers, of dates)
_DIGITS = frozenset(string.digits)
_LOG10 = math.log2(10)


def char_bits(text: str) -> float:
    """``text``'s length times log2 of the size of the character classes it uses;
    all hex digits (some digits and some of a-f): exactly 4 bits a character
    (log2 22 where a-f and A-F both appear).

    Example::

        >>> char_bits("e26f50983990e195909119904523568d")   # 32 hex digits
        128.0
    """
    used = set(text)
    digits = not used.isdisjoint(_DIGITS)
    if digits and _HEX.fullmatch(text) and not used <= _DIGITS:
        size = 10 + 6 * (not used.isdisjoint("abcdef")) + 6 * (not used.isdisjoint("ABCDEF"))
        return len(text) * math.log2(size)
    size = (26 * (not used.isdisjoint(string.ascii_lowercase))
            + 26 * (not used.isdisjoint(string.ascii_uppercase)) + 10 * digits)
    size += 33 if any(not c.isalnum() or not c.isascii() for c in used) else 0
    return len(text) * math.log2(max(size, 2))


def reads_as_words(letters: str) -> bool:
    """Whether a run of ASCII letters could be one word or several run together.

    Example::

        >>> reads_as_words("correcthorse"), reads_as_words("xkqzvbw")
        (True, False)
    """
    low = letters.lower()
    if not low.isascii():
        return len(low) >= 3   # another script: no English vowel test
    vowels = sum(c in "aeiou" for c in low) + 0.5 * low.count("y")
    return len(low) >= 3 and vowels >= 0.28 * len(low) and not _CONSONANTS.search(low)


def word_bits(text: str) -> float:
    """``text`` counted as words, digits and separators (see the module docstring).

    Example::

        >>> round(word_bits("correct-horse-battery"))   # three words; 124 as characters
        56
    """
    per_char = char_bits(text) / len(text) if text else 0.0
    bits, seen, in_words = 0.0, set(), 0
    toks = [m.group() for m in _TOKENS.finditer(text)]
    seps = Counter(t for t in toks if not t.isalnum())
    # words joined by one separator said again (``strengths-twelfths-angsts``, a
    # diceware phrase): each run of letters between them is a word, vowels or not
    joined = {t for t, n in seps.items() if n >= 2}
    for i, tok in enumerate(toks):
        chars = len(tok) * per_char
        between = joined and all(t in joined for t in toks[max(i - 1, 0):i + 2:2] if t != tok)
        if tok.isalpha() and (reads_as_words(tok) or (between and 3 <= len(tok) <= 14)):
            in_words += len(tok)
            words = max(1, round(len(tok) / WORD_LETTERS))
            bits += min(chars, words * WORD_BITS + (1.0 if tok[0].isupper() else 0.0))
        elif not tok.isalnum() and tok in seen:
            continue   # a separator used again: no new choice
        else:
            seen.add(tok)
            bits += chars
    # a few word-like runs in a random string (``Gupo`` in a token_urlsafe) are chance
    return bits if 2 * in_words >= len(text) else char_bits(text)


def _known() -> str:
    """What a guesser tries first, run together (a compressor's preset dictionary):
    the alphabet and digits in order, keyboard rows and columns, counting, digits of
    pi and e, each also backwards; words of a separator so nothing spans two of them."""
    pi = ("3141592653589793238462643383279502884197169399375105820974944592307816406286208998628"
          "0348253421170679821480865132823066470938446095505822317253594081284811174502841027019"
          "38521105559644622948954930381964428810975665933446128475648233786783165271201909145648")
    e = ("2718281828459045235360287471352662497757247093699959574966967627724076630353547594571"
         "38217852516642742746639193200305992181741359662904357290033429526059563073813232862794")
    # a US keyboard's columns, top to bottom, left to right; shifted
    cols = ["1qaz", "2wsx", "3edc", "4rfv", "5tgb", "6yhn", "7ujm", "8ik,", "9ol.", "0p;/"]
    shifted = ["!QAZ", "@WSX", "#EDC", "$RFV", "%TGB", "^YHN", "&UJM", "*IK<", "(OL>", ")P:?"]
    walks = []
    for keys in (cols, [k.rstrip(",./;") for k in cols], shifted):
        walks += ["".join(keys), "".join(k[::-1] for k in keys),            # down, up
                  "".join(k[1:] for k in keys), "".join(k[:0:-1] for k in keys),   # letters only
                  "".join(k[:2] for k in keys), "".join(k[1::-1] for k in keys)]   # 1q2w3e4r, q1w2e3r4
    walks += ["1a2s3d4f5g6h7j8k9l", "qawsedrftgyhujikolp"]
    seqs = [string.ascii_lowercase, string.ascii_uppercase, string.digits, "1234567890",
            "qwertyuiop", "asdfghjkl", "zxcvbnm", "QWERTYUIOP", "ASDFGHJKL", "ZXCVBNM",
            "qwertyuiopasdfghjklzxcvbnm", "QWERTYUIOPASDFGHJKLZXCVBNM", "azertyuiopqsdfghjklmwxcvbn",
            "qwertzuiopasdfghjklyxcvbnm", "!@#$%^&*()", *walks,
            "".join(str(i) for i in range(1, 1001)), pi, e]
    return "\x00".join(seqs + [x[::-1] for x in seqs]) + "\x00"


_KNOWN = _known()


def _index(text: str) -> dict[str, tuple[int, ...]]:
    starts: dict[str, list[int]] = {}
    for j in range(len(text) - _MIN_MATCH + 1):
        starts.setdefault(text[j:j + _MIN_MATCH], []).append(j)
    return {k: tuple(v[-_CHAIN:]) for k, v in starts.items()}


_KNOWN_STARTS = _index(_KNOWN)   # where each _MIN_MATCH characters of _KNOWN begin


def _int_bits(x: int) -> float:
    """What naming a whole number >= 0 costs (an Elias gamma code of x + 1)."""
    return 2.0 * math.log2(x + 1) + 1.0


def _common(s: str, j: int, at: int, end: int) -> tuple[int, int]:
    """(how many characters ``s[j:]`` and ``s[at:]`` share from their start, up to
    ``end``; the steps it took): compared by growing and shrinking slices, so a
    repetition of any length costs a few dozen steps."""
    k, step, steps, limit = 0, 8, 0, end - at
    while k < limit:
        steps += 1
        step = min(step, limit - k)
        if s[j + k:j + k + step] == s[at + k:at + k + step]:
            k += step
            step *= 2
        elif step > 1:
            step //= 2
        else:
            break
    return k, steps


def _arithmetic(text: str, i: int, per_char: float) -> tuple[float, int, float]:
    """(bits saved, length, cost) of the best run of three numbers or more in
    arithmetic progression from ``i`` (``2468101214``, ``1999 2000 2001``, ``05 10
    15``), one separator of up to three characters between them; (0, 0, 0) if none."""
    n, best = len(text), (0.0, 0, 0.0)
    e = i
    while e < n and e - i < 8 and text[e] in _DIGITS:
        e += 1
    for w in range(1, e - i + 1):
        first = text[i:i + w]
        pad = w if first[0] == "0" and w > 1 else 0   # zero-padded: 01 02 03
        a, j = int(first), i + w
        s = j
        while s < n and s - j < 3 and not text[s].isalnum():
            s += 1
        sep = text[j:s]
        for w2 in ((w,) if pad else (w - 1, w, w + 1)):
            second = text[s:s + w2]
            if (w2 < 1 or len(second) != w2 or not _DIGITS.issuperset(second)
                    or (not pad and w2 > 1 and second[0] == "0")):
                continue
            last = int(second)
            d, pos, k = last - a, s + w2, 2
            if d == 0:
                continue   # the same number again: a repeat
            while last + d >= 0:
                piece = sep + (f"{last + d:0{pad}d}" if pad else str(last + d))
                if not text.startswith(piece, pos):
                    break
                last, pos, k = last + d, pos + len(piece), k + 1
            if k < 3:
                continue
            cost = (w * _LOG10 + _int_bits(abs(d)) + 1.0 + _int_bits(k) + len(sep) * per_char
                    + _SEQ_BITS)
            saving = (pos - i) * per_char - cost
            if saving > best[0]:
                best = (saving, pos - i, cost)
    return best


_DATE = re.compile(r"(\d{4})([-/. ]?)(\d\d)\2(\d\d)|(\d\d)([-/. ]?)(\d\d)\6(\d{4})")
_FIRST_DAY, _LAST_DAY = datetime.date(1900, 1, 1).toordinal(), datetime.date(2099, 12, 31).toordinal()
# a day of 1900-2099, and which of 3 orders and 5 separators writes it
_DATE_BITS = math.log2(_LAST_DAY - _FIRST_DAY + 1) + math.log2(15)


def _day(y: int, m: int, d: int) -> datetime.date | None:
    try:
        day = datetime.date(y, m, d)
    except ValueError:
        return None
    return day if _FIRST_DAY <= day.toordinal() <= _LAST_DAY else None


def _write(day: datetime.date, order: str, sep: str) -> str:
    y, m, d = f"{day.year:04d}", f"{day.month:02d}", f"{day.day:02d}"
    return sep.join({"ymd": (y, m, d), "dmy": (d, m, y), "mdy": (m, d, y)}[order])


def _date_at(text: str, i: int, order: str | None = None) -> tuple[str, str, datetime.date] | None:
    """(order, separator, day) of the date written at ``i`` (in ``order`` if given)."""
    m = _DATE.match(text, i)
    if m is None:
        return None
    if m.group(1):
        orders = [("ymd", m.group(2), (int(m.group(1)), int(m.group(3)), int(m.group(4))))]
    else:
        a, b, y = int(m.group(5)), int(m.group(7)), int(m.group(8))
        orders = [("dmy", m.group(6), (y, b, a)), ("mdy", m.group(6), (y, a, b))]
    for o, sep, ymd in orders:
        day = _day(*ymd) if order in (None, o) else None
        if day is not None:
            return o, sep, day
    return None


def _shift(day: datetime.date, step: int, months: bool) -> datetime.date | None:
    if not months:
        n = day.toordinal() + step
        return datetime.date.fromordinal(n) if _FIRST_DAY <= n <= _LAST_DAY else None
    total = day.year * 12 + day.month - 1 + step
    return _day(total // 12, total % 12 + 1, day.day)


def _dates(text: str, i: int, per_char: float) -> tuple[float, int, float]:
    """(bits saved, length, cost) of the date at ``i`` and the run of dates after it
    a fixed number of days (or months) apart, one separator between them; (0, 0, 0)
    if no date is written at ``i``."""
    found = _date_at(text, i)
    if found is None:
        return 0.0, 0, 0.0
    order, dsep, day = found
    one = len(_write(day, order, dsep))
    best = (one * per_char - _DATE_BITS - _SEQ_BITS, one, _DATE_BITS + _SEQ_BITS)
    j = s = i + one
    while s < len(text) and s - j < 3 and not text[s].isalnum():
        s += 1
    sep = text[j:s]
    second = _date_at(text, s, order)
    if second is None or second[1] != dsep or second[2] == day:
        return best
    nxt = second[2]
    steps = [(nxt.toordinal() - day.toordinal(), False)]
    if nxt.day == day.day:
        steps.append(((nxt.year - day.year) * 12 + nxt.month - day.month, True))
    for step, months in steps:
        pos, k, cur = s + one, 2, nxt
        while True:
            cur = _shift(cur, step, months)
            piece = None if cur is None else sep + _write(cur, order, dsep)
            if piece is None or not text.startswith(piece, pos):
                break
            pos, k = pos + len(piece), k + 1
        cost = (_DATE_BITS + _int_bits(abs(step)) + 2.0 + _int_bits(k) + len(sep) * per_char
                + _SEQ_BITS)
        saving = (pos - i) * per_char - cost
        if saving > best[0]:
            best = (saving, pos - i, cost)
    return best


class _Parse:
    """The state of one left-to-right read of a text (see :func:`repeat_bits`)."""

    def __init__(self, text: str, per_char: float) -> None:
        self.text, self.per_char = text, per_char
        self.base = len(_KNOWN)
        self.full = _KNOWN + text            # references may reach into the known sequences
        self.end = self.base + len(text)
        self.where = math.log2(self.end) + 1   # where a reference points, and that it is one
        self.starts: dict[str, list[int]] = {}   # where each _MIN_MATCH characters began
        self.done = self.base - _MIN_MATCH + 1   # indexed below this (_KNOWN's: _KNOWN_STARTS)
        self.work = 0

    def best(self, i: int) -> tuple[float, int, float]:
        """(bits saved, length, cost) of the stretch at ``i`` that saves the most."""
        full, at = self.full, self.base + i
        for j in range(self.done, at):
            self.starts.setdefault(full[j:j + _MIN_MATCH], []).append(j)
        self.work += 4 + max(0, at - self.done)
        self.done = max(self.done, at)
        found, longest = (0.0, 1, self.per_char), 0
        gram = full[at:at + _MIN_MATCH]
        near = self.starts.get(gram, ())   # the most recent first, then the known sequences'
        for j in (near[-_CHAIN:] if len(near) >= _CHAIN
                  else [*_KNOWN_STARTS.get(gram, ())[len(near) - _CHAIN:], *near]):
            k, steps = _common(full, j, at, self.end)
            self.work += steps
            longest = max(longest, k)
        if longest >= _MIN_MATCH:
            ref = self.where + math.log2(longest)   # ... and how long
            found = (longest * self.per_char - ref, longest, ref)
        if self.text[i] in _DIGITS:
            for run in (_arithmetic(self.text, i, self.per_char), _dates(self.text, i, self.per_char)):
                if run[0] > found[0]:
                    found = run
            self.work += 24
        return found


def repeat_bits(text: str, per_char: float) -> float:
    """``text`` read left to right, each character costing ``per_char`` bits unless it
    starts a stretch that names itself for less (:data:`_MARGIN` bits less or more):
    one that repeats one before it (:data:`_MIN_MATCH` characters or more), one of
    the sequences a guesser tries first (:data:`_KNOWN`), a run of numbers or of
    dates (see the module docstring). A stretch waits a character where the next
    one saves more (as zlib's lazy matching: `` 2024-0`` said before must not
    take the start of a run of dates). After :data:`_WORK` steps the rest is
    counted by deflate, with the known sequences and what was read as its
    dictionary.

    Example::

        >>> repeat_bits("password" * 8, 4.7) < 60          # one word, then "7 times that"
        True
    """
    n, parse = len(text), _Parse(text, per_char)
    bits, i, ahead = 0.0, 0, None
    while i < n:
        if parse.work > _WORK:
            return bits + _rest_bits(text, i, per_char)
        saving, length, cost = ahead if ahead is not None else parse.best(i)
        ahead = None
        if saving > _MARGIN and i + 1 < n:
            ahead = parse.best(i + 1)
            if ahead[0] > saving:
                saving = 0.0   # a literal here, the better stretch next
        if saving > _MARGIN:
            bits += cost
            i += length
            ahead = None
        else:
            bits += per_char
            i += 1
    return bits


def _rest_bits(text: str, i: int, per_char: float) -> float:
    """``text[i:]`` counted by raw deflate (with the known sequences and ``text[:i]``
    as its dictionary), or as characters if that is less; past :data:`_DEFLATE_LIMIT`
    characters, as characters. (Level 4: within some 15 % of level 9's count, where
    level 9 spends seconds on a MiB of two letters at random.)"""
    rest, beyond = text[i:i + _DEFLATE_LIMIT], max(0, len(text) - i - _DEFLATE_LIMIT)
    seen = (_KNOWN + text[:i])[-(32 << 10):].encode("utf-8", "surrogatepass")[-(32 << 10):]
    z = zlib.compressobj(4, zlib.DEFLATED, -15, zdict=seen)
    packed = z.compress(rest.encode("utf-8", "surrogatepass")) + z.flush()
    return min(len(rest) * per_char, 8.0 * len(packed)) + beyond * per_char


def secret_bits(secret: bytes) -> float:
    """A rough upper bound on the entropy of ``secret``: the smallest of its count as
    characters, as words and as what a guesser tries first (see the module
    docstring); bytes that are not UTF-8 count 8 bits each, less what repeats. The
    work is bounded whatever the length.

    Example::

        >>> secret_bits(secrets.token_hex(16).encode())   # 32 hex digits: 4 bits each
        128.0
        >>> secret_bits(b"1qaz2wsx3edc4rfv5tgb") < 40     # a keyboard's columns
        True
    """
    try:
        text = secret.decode()
    except UnicodeDecodeError:
        return min(8.0 * len(secret), repeat_bits(secret.decode("latin-1"), 8.0))
    if not text:
        return 0.0
    wrapped = _WRAPPED_HEX.fullmatch(text)
    if wrapped is not None and not _HEX.fullmatch(text):
        # hex digits in a common wrapper (a uuid's dashes, colons, a 0x prefix): the
        # digits count 4 bits each, the wrapper nothing (a guesser knows the format)
        digits = re.sub(r"[^0-9a-fA-F]", "", wrapped.group(1))
        if not set(digits) <= _DIGITS and not set(digits).isdisjoint(_DIGITS):
            return min(secret_bits(digits.encode()), char_bits(text))
    chars = char_bits(text)
    per_char = chars / len(text)
    if _HEX.fullmatch(text):
        # all hex digits: a random token (secrets.token_hex), whose letter runs read as
        # words by chance; the few words of a-f alone are left to the repetition count
        words = chars
    else:
        head = text[:_WORDS_LIMIT]
        words = word_bits(head) + per_char * (len(text) - len(head))
    return min(chars, words, repeat_bits(text, per_char))
