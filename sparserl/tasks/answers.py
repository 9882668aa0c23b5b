"""Answers in completions and references: `\\boxed{}` and `#### N` extraction, units and thousands separators,
exact numeric parsing and comparison (the fast path of reward equivalence), and the format reward."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_BOX_COMMANDS = ("\\boxed", "\\fbox")

# ----------------------------------------------------------------------------------------------- extraction


def _match_brace(text: str, open_at: int) -> int | None:
    """Index of the `}` closing the `{` at `open_at`, skipping escaped braces; None if unbalanced."""
    depth = 0
    i = open_at
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _boxed_spans(text: str) -> list[str]:
    """Contents of every well-formed `\\boxed{...}` / `\\fbox{...}` (or `\\boxed 5`), in order."""
    found: list[tuple[int, str]] = []
    for cmd in _BOX_COMMANDS:
        start = 0
        while (at := text.find(cmd, start)) != -1:
            j = at + len(cmd)
            start = j
            if j < len(text) and (text[j].isalpha()):  # e.g. \boxedfoo: another command
                continue
            k = j
            while k < len(text) and text[k] == " ":
                k += 1
            if k < len(text) and text[k] == "{":
                end = _match_brace(text, k)
                if end is not None:
                    found.append((at, text[k + 1 : end]))
            elif k > j:  # `\boxed 5`: up to whitespace or `$`
                m = re.match(r"[^\s$]+", text[k:])
                if m:
                    found.append((at, m.group(0)))
    found.sort(key=lambda t: t[0])
    return [s for _, s in found]


def extract_boxed(text: str) -> str | None:
    """Content of the last well-formed `\\boxed{...}` (nested and escaped braces handled), or None."""
    spans = _boxed_spans(text)
    return spans[-1].strip() if spans else None


def extract_hash_answer(text: str) -> str | None:
    """The answer after the last `#### ` marker (GSM8K style), thousands separators removed, or None."""
    at = text.rfind("####")
    if at == -1:
        return None
    ans = text[at + 4 :].strip().split("\n", 1)[0].strip().rstrip(".").strip()
    return _strip_thousands(ans) or None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion: the last `\\boxed{}`, else `#### N`, else None."""
    boxed = extract_boxed(text)
    return boxed if boxed is not None else extract_hash_answer(text)


def reference_answer(value: Any) -> str:
    """Normalize a dataset's reference to the bare final answer: lists are joined with ', ', floats that are
    integers lose '.0', a rationale ending in `#### N` or containing `\\boxed{}` is reduced to it, and units
    after a plain number are dropped (`drop_units`)."""
    if isinstance(value, (list, tuple)):
        return ", ".join(reference_answer(v) for v in value)
    if isinstance(value, bool) or value is None:
        raise ValueError(f"reference answer {value!r} is not a string or number")
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, int):
        return str(value)
    text = str(value).strip()
    if "####" in text:
        return drop_units(extract_hash_answer(text) or "")
    if any(cmd in text for cmd in _BOX_COMMANDS):
        boxed = extract_boxed(text)
        if boxed is not None:
            return drop_units(boxed)
    return drop_units(text)


_CURRENCY = r"(?:\\?\$|€|£|¥)"
_PLAIN_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?"  # 1,200.50  -3  0.5  3/4
_UNIT_WORD = r"[^\W\d_]+\.?(?:\^[23]|[²³])?"  # cm  apples  ft.  cm^2  m²
# a parenthesis of words, or one with numbers and a word of 2+ letters: ' (apples)', ' (from 4+5)'
_PAREN = r"\((?:[^()\d\\$]*|(?=[^()]*[^\W\d_]{2})[^()\\$]*)\)"
_UNITS = rf"(?:\s+{_UNIT_WORD}(?:/{_UNIT_WORD})*|\s*{_PAREN})*"  # ' km/h', ' (apples)': spaced out
_NUMBER_WITH_UNITS = re.compile(
    rf"(?P<currency>{_CURRENCY})?\s*(?P<number>{_PLAIN_NUMBER})(?P<units>{_UNITS})\s*\.?"
)
# Words that make `3 pi` or `2 sqrt` an expression, not a number with a unit.
_MATH_WORDS = {"pi", "sqrt", "sin", "cos", "tan", "log", "ln", "exp", "inf", "infinity", "mod", "deg"}


def drop_units(answer: str) -> str:
    """A reference answer without its currency sign or units: a plain number followed only by words or a
    parenthesised phrase (`9 (apples)`, `15 cm`, `12 km/h`, `$1,200.50`) becomes the number (`9`, `15`,
    `12`, `1200.50`). Anything else is kept as written (`\\frac{1}{2}`, `x^2+1`, `(1, 2)`, `2 \\sqrt{3}`,
    `3 pi`, `2x`, `2 x`, `10\\%`, `5 \\text{ cm}`: math-verify reads LaTeX units itself): a one-letter word
    may be a variable. A parenthesis may hold numbers beside words (`9 (from 4+5)`: a working, dropped).
    Without it a correct `\\boxed{9}` scored 0 against `9 (apples)`."""
    text = strip_dollars(answer)
    m = _NUMBER_WITH_UNITS.fullmatch(text)
    if m is None or not (m["currency"] or m["units"]):
        return text
    words = [w.lower() for w in re.findall(r"[^\W\d_]+", m["units"])]
    if m["units"] and (sum(map(len, words)) < 2 or _MATH_WORDS.intersection(words)):
        return text
    return m["number"].replace(",", "")


def format_reward(completion_text: str) -> float:
    """1.0 when the completion holds a well-formed, non-empty `\\boxed{...}`, else 0.0."""
    return 1.0 if any(s.strip() for s in _boxed_spans(completion_text)) else 0.0


# --------------------------------------------------------------------------------------------- numeric path

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_FRACTION = re.compile(r"[-+]?\d+/\d+")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def strip_dollars(s: str) -> str:
    s = s.strip()
    while len(s) >= 2 and s[0] == "$" and s[-1] == "$":
        s = s[1:-1].strip()
    return s


def _strip_thousands(s: str) -> str:
    s = s.replace("{,}", ",")
    return s.replace(",", "") if _THOUSANDS.fullmatch(s) else s


def parse_number(s: str) -> Fraction | None:
    """Exact value of a plain number ('42', '-3.50', '1,000', '3/4', '$7$', '\\$5', '7.'), else None."""
    s = strip_dollars(s)
    s = s.replace("\\!", "").replace("\\,", "").replace("\\ ", "").replace(" ", "")
    if s.startswith("\\$"):
        s = s[2:]
    m = re.fullmatch(r"\\text\{(.*)\}", s)
    if m:
        s = m.group(1)
    s = _strip_thousands(s)
    if _NUMBER.fullmatch(s) or _FRACTION.fullmatch(s):
        try:
            return Fraction(s)
        except (ValueError, ZeroDivisionError):
            return None
    return None


def numeric_match(gold: str, pred: str) -> bool | None:
    """Fast path: True/False when both are plain numbers and the comparison is exact, None to defer.

    Unequal values are only decided when neither has a decimal point (decimals may be rounded and are left
    to math-verify's tolerance)."""
    g, p = parse_number(gold), parse_number(pred)
    if g is None or p is None:
        return None
    if g == p:
        return True
    if "." not in gold and "." not in pred:
        return False
    return None
