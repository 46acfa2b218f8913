"""Math rewards: answers are found where models and datasets put them, and checked by value, not spelling."""

import pytest

from jaxreplay.tasks.rewards import (
    REWARDS, exact_match, extract_boxed, extract_gsm8k, extract_last_number, get_reward, gsm8k,
    is_equivalent, math_equivalence)


@pytest.mark.parametrize(
    "text, boxed",
    [
        (r"so the answer is $\boxed{42}$.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"first \boxed{1} then \boxed{\sqrt{x^{2}+1}}", r"\sqrt{x^{2}+1}"),  # the last box, nested braces
        (r"\boxed 5$ done", "5"),
        (r"\fbox{7}", "7"),
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)"),
        (r"no box here: 12", None),
        (r"\boxed{unclosed {", None),
    ],
)
def test_extract_boxed(text, boxed):
    assert extract_boxed(text) == boxed


def test_extract_gsm8k_and_last_number():
    assert extract_gsm8k("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"
    assert extract_gsm8k("#### 1,234\n") == "1,234"
    assert extract_gsm8k("no marker 5") is None
    assert extract_last_number("It costs $1,250.50. Then 3 more, so -7.") == "-7"
    assert extract_last_number("total: 1,250.50.") == "1,250.50"
    assert extract_last_number("none") is None


@pytest.mark.parametrize(
    "a, b",
    [
        ("0.5", r"\frac{1}{2}"),
        (r"\dfrac{3}{4}", r"\frac34"),
        (r"\tfrac{3}{4}", "3/4"),
        ("-\\frac{1}{3}", "-1/3"),
        ("1,000", "1000"),
        ("50\\%", "50"),
        ("2.50", "2.5"),
        ("x = 5", "5"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"[0.5, \frac{3}{2}]", r"\left[\frac12, 1.5\right]"),
        (r"\text{(B)}", "(B)"),
        ("10 cm", "10"),
        (r"90^\circ", "90"),
        (r"\$18.90", "18.9"),
        (r"\sqrt2", r"\sqrt{2}"),
        (r"3\sqrt{2}", r"3 \sqrt{2}"),
    ],
)
def test_equivalent_spellings(a, b):
    assert is_equivalent(a, b) and is_equivalent(b, a)


@pytest.mark.parametrize(
    "a, b",
    [
        ("0.33", r"\frac{1}{3}"),  # no tolerance: a rounded value is not the exact answer
        ("(1,2)", "[1,2]"),  # an open interval is not a closed one
        ("1,2", "12"),  # a list is not a number with a thousands separator
        (r"2\sqrt{2}", r"\sqrt{8}"),  # no symbolic algebra
        ("1/0", "0"),  # a division by zero is no number
        ("", ""),
        (None, "1"),
    ],
)
def test_not_equivalent(a, b):
    assert not is_equivalent(a, b)


def test_math_equivalence_reads_the_last_box_against_a_solution_or_bare_answer():
    solution = r"We get $x = \frac{6}{4}$, i.e. $\boxed{\dfrac{3}{2}}$."
    assert math_equivalence(r"... so \boxed{1.5}", solution) == 1.0
    assert math_equivalence(r"... so \boxed{1.5}", "3/2") == 1.0
    assert math_equivalence(r"... \boxed{2} no wait \boxed{1.5}", solution) == 1.0
    assert math_equivalence(r"... \boxed{1.5} no wait \boxed{2}", solution) == 0.0
    assert math_equivalence("the answer is 1.5", solution) == 0.0  # unboxed answers do not count


def test_gsm8k_reward_falls_back_from_marker_to_box_to_last_number():
    reference = "She has 3 + 4 = 7 apples.\n#### 7"
    assert gsm8k("3 + 4 = 7\n#### 7", reference) == 1.0
    assert gsm8k(r"so \boxed{7}", reference) == 1.0
    assert gsm8k("3 + 4 = 7 apples.", reference) == 1.0
    assert gsm8k("3 + 4 = 8", reference) == 0.0
    assert gsm8k("#### 1,000", "1000") == 1.0


def test_exact_match():
    assert exact_match(" 42\n", "42") == 1.0
    assert exact_match("42.0", "42") == 0.0


def test_registry_by_name():
    assert set(REWARDS) == {"math_equivalence", "gsm8k", "exact_match"}
    assert get_reward("gsm8k") is gsm8k
    with pytest.raises(ValueError, match="task.reward: unknown reward 'nope'"):
        get_reward("nope")
