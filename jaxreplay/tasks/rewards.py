"""Verifiable rewards for math: answer extraction, equivalence, and a registry by name.

A reward function maps (completion text, reference text) to a float. The reference
may be a bare answer (`42`, `\\frac{1}{2}`) or a whole reference solution: the same
extraction is applied to both sides, so a MATH solution's `\\boxed{}` or a GSM8K
answer's `#### 42` is found either way.

Equivalence is deliberately simple and exact: strings equal after normalising
LaTeX spelling (`\\dfrac` -> `\\frac`, `\\left(` -> `(`, spaces, `$`, `\\%`, text
units), or numbers equal as exact fractions (`0.5`, `1/2`, `\\frac{1}{2}`,
`1,000`), element-wise for tuples and intervals. No symbolic algebra: `2\\sqrt{2}`
and `\\sqrt{8}` differ. Pure string code with no backtracking-prone regexes, so a
long completion costs linear time.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Callable, Optional

RewardFn = Callable[[str, str], float]


# ----------------------------------------------------------------------------------
# Extraction


def extract_boxed(text: str) -> Optional[str]:
    """Contents of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces balanced.

    `\\boxed 5` (no braces) gives `5`. None if there is no box or its braces never close.
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if i < len(text) and text[i] == " ":  # `\boxed 5`: the argument runs to the next space or `$`
        rest = text[i + 1:]
        return re.split(r"[\s$]", rest, maxsplit=1)[0] or None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_last_number(text: str) -> Optional[str]:
    """The last number in the text (`-1,234.5` kept whole, a trailing full stop dropped)."""
    found = _NUMBER.findall(text)
    return found[-1].rstrip(",") if found else None


def extract_gsm8k(text: str) -> Optional[str]:
    """The number after the last `####` (GSM8K's answer marker)."""
    marker = text.rfind("####")
    if marker < 0:
        return None
    return extract_last_number(text[marker + 4:].split("\n", 1)[0]) or text[marker + 4:].strip() or None


# ----------------------------------------------------------------------------------
# Normalisation and equivalence

_DROP = ["\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "\\$", "$", "^{\\circ}", "^\\circ",
         "\\%", "%", "\\ "]
_RENAME = [("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\cdot", "*"), ("\\times", "*"), ("\\{", "{"),
           ("\\}", "}")]
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_FRAC_SHORT = re.compile(r"\\frac(\d)(\d)")  # \frac12 -> \frac{1}{2}
_SQRT_SHORT = re.compile(r"\\sqrt(\d+)")  # \sqrt2 -> \sqrt{2}
_LHS = re.compile(r"[a-zA-Z]\w*\s*=(?!=)")  # `x = 5` -> `5`
_UNITS = re.compile(r"\s*(?:units?|degrees?|cm|meters?|inches|feet|dollars?|cents?)\s*$")


def normalize(answer: str) -> str:
    """A canonical spelling: LaTeX sizing and spacing dropped, one fraction macro, no units."""
    s = answer.strip()
    s = _TEXT.sub(r"\1", s)
    for token in _DROP:
        s = s.replace(token, "")
    for old, new in _RENAME:
        s = s.replace(old, new)
    s = _UNITS.sub("", s.strip())
    s = s.strip().rstrip(".").strip()
    if _LHS.match(s) and s.count("=") == 1:
        s = s.split("=", 1)[1]
    s = s.replace(" ", "")
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    return s


_FRAC = re.compile(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}")
_SLASH = re.compile(r"(-?[\d.]+)/(-?[\d.]+)")
_PLAIN = re.compile(r"-?(?:\d+\.?\d*|\.\d+)")


def to_number(s: str) -> Optional[Fraction]:
    """An exact value for a normalised integer, decimal, `a/b` or `\\frac{a}{b}`; else None."""
    try:
        if _PLAIN.fullmatch(s):
            return Fraction(s)
        if m := _FRAC.fullmatch(s):
            value = Fraction(m.group(2)) / Fraction(m.group(3))
            return -value if m.group(1) else value
        if m := _SLASH.fullmatch(s):
            return Fraction(m.group(1)) / Fraction(m.group(2))
    except ZeroDivisionError:
        return None
    return None


def _split_top_level(s: str) -> list[str]:
    """Splits on commas outside any brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def _atoms_equal(a: str, b: str) -> bool:
    if a == b:
        return True
    x, y = to_number(a), to_number(b)
    return x is not None and y is not None and x == y


def is_equivalent(prediction: Optional[str], reference: Optional[str]) -> bool:
    """Equal after normalisation, numerically, or element-wise for tuples, intervals and lists."""
    if prediction is None or reference is None:
        return False
    a, b = normalize(prediction), normalize(reference)
    if not a or not b:
        return False
    if _atoms_equal(a, b):
        return True
    brackets = "([", ")]"
    if len(a) > 1 and len(b) > 1 and a[0] in brackets[0] and a[-1] in brackets[1]:
        if a[0] != b[0] or a[-1] != b[-1]:  # (1, 2) is not [1, 2]
            return False
        a, b = a[1:-1], b[1:-1]
    xs, ys = _split_top_level(a), _split_top_level(b)
    return len(xs) > 1 and len(xs) == len(ys) and all(_atoms_equal(x, y) for x, y in zip(xs, ys))


# ----------------------------------------------------------------------------------
# Reward functions and their registry


def math_equivalence(completion: str, reference: str) -> float:
    """1.0 iff the completion's last `\\boxed{}` is equivalent to the reference's (or to the
    whole reference when it has no box)."""
    ref = extract_boxed(reference)
    return float(is_equivalent(extract_boxed(completion), reference if ref is None else ref))


def gsm8k(completion: str, reference: str) -> float:
    """1.0 iff the completion's final answer (`#### n`, else `\\boxed{}`, else the last number)
    equals the reference's (`#### n`, else the whole reference)."""
    pred = extract_gsm8k(completion) or extract_boxed(completion) or extract_last_number(completion)
    ref = extract_gsm8k(reference) or reference
    return float(is_equivalent(pred, ref))


def exact_match(completion: str, reference: str) -> float:
    """1.0 iff the completion equals the reference, surrounding whitespace aside."""
    return float(completion.strip() == reference.strip())


REWARDS: dict[str, RewardFn] = {
    "math_equivalence": math_equivalence,
    "gsm8k": gsm8k,
    "exact_match": exact_match,
}


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise ValueError(f"task.reward: unknown reward {name!r} (known: {', '.join(sorted(REWARDS))})")
    return REWARDS[name]
