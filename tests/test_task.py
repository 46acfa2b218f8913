"""The embedded arithmetic task: tokenizer, prompt stream, rewards and held-out eval set."""

import numpy as np
import pytest

from jaxreplay.config import TaskConfig
from jaxreplay.tasks import ArithmeticTask, Problem


def task(**kw):
    return ArithmeticTask(TaskConfig(**kw))


def test_tokenizer_round_trip_stops_at_eos():
    tok = task().tokenizer
    ids = tok.encode("12+34=") + [tok.EOS] + tok.encode("99")
    assert tok.decode(ids) == "12+34="


def test_reward_is_exact_match_with_eos():
    t = task()
    tok = t.tokenizer
    p = Problem(12, "+", 34)
    assert t.reward(p, tok.encode("46") + [tok.EOS, tok.PAD]) == 1.0
    assert t.reward(p, tok.encode("46")) == 0.0  # never stopped
    assert t.reward(p, tok.encode("460") + [tok.EOS]) == 0.0
    assert t.reward(p, tok.encode("45") + [tok.EOS]) == 0.0


def test_other_operations():
    assert Problem(3, "-", 10).answer == "-7"
    assert Problem(12, "*", 11).answer == "132"


def test_prompts_are_left_padded_to_a_fixed_length():
    t = task(max_digits=3)
    tokens, mask = t.encode_prompts([Problem(1, "+", 2), Problem(123, "+", 456)])
    assert tokens.shape == (2, t.prompt_len) == (2, 9)
    assert mask[0].tolist() == [False] * 4 + [True] * 5
    assert mask[1].all()
    assert tokens[0, 4] == t.tokenizer.BOS


def test_train_stream_is_deterministic_and_excludes_eval_problems():
    t = task(min_digits=1, max_digits=1, eval_size=50)  # 100 possible problems, half held out
    held_out = set(t.eval_problems)
    assert len(held_out) == 50
    a = t.train_problems(seed=0, index=3, n=200)
    assert a == t.train_problems(seed=0, index=3, n=200)
    assert a != t.train_problems(seed=0, index=4, n=200)
    assert not held_out.intersection(a)


def test_supervised_batch_masks_exactly_the_answer():
    t = task()
    tokens, attention, loss_mask = t.supervised_batch(seed=0, index=0, n=4, max_new_tokens=6)
    problems = t.train_problems(0, 0, 4)
    for i, p in enumerate(problems):
        answer = tokens[i][loss_mask[i]]
        assert t.tokenizer.decode(answer) == p.answer and answer[-1] == t.tokenizer.EOS
    assert not np.any(loss_mask & ~attention)


def test_operands_are_zero_padded_and_answers_reversed_by_default():
    t = task(min_digits=1, max_digits=2)
    p = t.train_problems(seed=0, index=0, n=1)[0]
    assert len(p.text) == 6  # "dd+dd="
    assert Problem(56, "+", 34, width=2, reverse=True).text == "56+34="
    assert Problem(56, "+", 34, width=2, reverse=True).answer == "09"
    assert Problem(3, "-", 10, width=2, reverse=True).answer == "7-"
    assert Problem(5, "+", 7, width=2).text == "05+07="


def test_the_sloppy_teacher_forgets_exactly_the_carries():
    assert Problem(56, "+", 34).carry_free_answer == "80"
    assert Problem(99, "+", 99).carry_free_answer == "88"
    assert Problem(12, "+", 34).carry_free_answer == Problem(12, "+", 34).answer == "46"
    assert Problem(56, "+", 34, reverse=True).carry_free_answer == "08"


def test_teacher_error_rate_applies_to_carry_problems_only():
    t = task(min_digits=2, max_digits=2)
    n = 2000
    tokens, _, loss_mask = t.supervised_batch(seed=1, index=0, n=n, max_new_tokens=5, carry_error=0.75)
    problems = t.train_problems(1, 0, n)
    slipped = carried = 0
    for i, p in enumerate(problems):
        written = t.tokenizer.decode(tokens[i][loss_mask[i]])
        if p.answer == p.carry_free_answer:
            assert written == p.answer
        else:
            carried += 1
            slipped += written == p.carry_free_answer
            assert written in (p.answer, p.carry_free_answer)
    assert slipped / carried == pytest.approx(0.75, abs=0.05)
    exact, _, mask = t.supervised_batch(seed=1, index=0, n=50, max_new_tokens=5)
    assert all(t.tokenizer.decode(exact[i][mask[i]]) == p.answer for i, p in enumerate(t.train_problems(1, 0, 50)))
