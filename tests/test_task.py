"""The embedded arithmetic task: tokenizer, prompt stream, rewards and held-out eval set."""

import numpy as np
import pytest

from jaxreplay.config import TaskConfig
from jaxreplay.tasks.arithmetic import ArithmeticTask, Problem


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


def test_the_scratchpad_works_every_column_with_its_carry_then_answers():
    p = Problem(456, "+", 789, width=3, reverse=True, scratchpad=True)
    assert p.completion == "6+9+0=15,5+8+1=14,4+7+1=12:5421"
    assert p.carry_free_completion == "6+9+0=15,5+8+0=13,4+7+0=11:531"  # every carry in written as 0
    assert Problem(456, "+", 789, width=3, scratchpad=True).completion.endswith(":1245")
    assert Problem(12, "+", 3, width=3, reverse=True, scratchpad=True).completion == "2+3+0=05,1+0+0=01,0+0+0=00:51"
    assert Problem(12, "+", 34).completion == "46"  # no scratchpad: the answer alone


def test_the_scratchpad_reward_reads_the_answer_after_the_last_colon():
    t = task(min_digits=3, max_digits=3, scratchpad=True)
    tok = t.tokenizer
    p = Problem(456, "+", 789, width=3, reverse=True, scratchpad=True)
    reward = lambda text, eos=True: t.reward(p, tok.encode(text) + [tok.EOS] * eos)
    assert reward(p.completion) == 1.0
    assert reward("1+1+1=11:5421") == 1.0  # a wrong scratchpad with the right answer still scores
    assert reward(p.carry_free_completion) == 0.0
    assert reward("5421") == 0.0  # no ':': no answer
    assert reward(p.completion, eos=False) == 0.0
    assert t.answer_len == 32 and len(p.completion) + 1 == 32  # 10 tokens a digit + 2


def test_the_scratchpad_warm_start_teaches_the_format_with_the_teachers_slips():
    t = task(min_digits=4, max_digits=4, scratchpad=True)
    n = 400
    tokens, _, loss_mask = t.supervised_batch(seed=1, index=0, n=n, max_new_tokens=42, carry_error=0.75)
    slipped = carried = 0
    for i, p in enumerate(t.train_problems(1, 0, n)):
        written = tokens[i][loss_mask[i]]
        assert written[-1] == t.tokenizer.EOS and len(written) <= 42
        text = t.tokenizer.decode(written)
        assert text in (p.completion, p.carry_free_completion)
        if p.answer != p.carry_free_answer:
            carried += 1
            slipped += text == p.carry_free_completion
    assert slipped / carried == pytest.approx(0.75, abs=0.07)


@pytest.mark.parametrize("overrides, key", [
    (["task.operations=[+,-]"], "task.scratchpad"),
    (["sampling.max_new_tokens=41"], "sampling.max_new_tokens"),
])
def test_scratchpad_settings_are_validated_by_the_task(overrides, key):
    from jaxreplay.config import ConfigError, load_config

    base = ["task.scratchpad=true", "task.min_digits=4", "task.max_digits=4", "model.max_seq_len=64",
            "sampling.max_new_tokens=42"]
    load_config(None, base)
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        load_config(None, base + overrides)


def test_a_product_scratchpad_writes_each_partial_product_and_the_running_sum():
    p = Problem(347, "*", 26, width=3, reverse=True, scratchpad=True)
    assert p.completion == "6*2802=280200,2*4960=220900,0*0000=220900:2209"
    assert p.value == 9022
    t = task(min_digits=3, max_digits=3, operations=("*",), scratchpad=True)
    assert t.answer_len == 3 * (3 * 3 + 5) + 6 + 1  # rows, a six-digit answer, EOS
    longest = Problem(999, "*", 999, width=3, reverse=True, scratchpad=True)
    assert len(longest.completion) + 1 == t.answer_len


def test_the_sloppy_teacher_drops_the_carries_of_each_digit_product():
    p = Problem(347, "*", 26, width=3, reverse=True, scratchpad=True)
    # 347 * 6 without carries: 3*6=18 -> 8, 4*6=24 -> 4, 7*6=42 -> 2: 842; 347 * 2: 684 -> shifted 6840
    assert p.carry_free_completion == "6*2480=248000,2*4860=286700,0*0000=286700:2867"
    assert p.carry_free_answer == "2867" != p.answer
    assert Problem(111, "*", 3, width=3, reverse=True, scratchpad=True).carry_free_answer == "333"


def test_product_rewards_read_the_answer_after_the_scratchpad():
    t = task(min_digits=3, max_digits=3, operations=("*",), scratchpad=True)
    p = Problem(347, "*", 26, width=3, reverse=True, scratchpad=True)
    reward = lambda text: t.reward(p, t.tokenizer.encode(text) + [t.tokenizer.EOS])  # noqa: E731
    assert reward(p.completion) == 1.0
    assert reward(p.carry_free_completion) == 0.0
    assert reward("1*0000=000000:2209") == 1.0  # a wrong scratchpad with the right answer still scores


def test_test_validation_and_training_pool_are_disjoint_and_fixed_by_the_data_seed():
    kw = dict(min_digits=3, max_digits=3, operations=("*",), eval_size=300, validation_size=200, train_size=500)
    t = task(**kw)
    test, val, pool = set(t.eval_problems), set(t.validation_problems), set(t._pool.items)
    assert (len(test), len(val), len(pool)) == (300, 200, 500)
    assert not test & val and not pool & (test | val)
    again = task(**kw)
    assert again.eval_problems == t.eval_problems and again.validation_problems == t.validation_problems
    assert task(**{**kw, "data_seed": 7}).validation_problems != t.validation_problems
    # without a validation split or a pool the test split is the one earlier results were measured on
    alone = task(**{**kw, "validation_size": 0, "train_size": 0})
    assert alone.eval_problems == alone._unique_problems(np.random.default_rng([1234, 0xE7A1]), 300)


def test_the_splits_are_alike_where_draws_are_not_uniform():
    """min_digits=1, max_digits=2 draws the digit count first: one-digit operands are half of all
    draws but 10 of 100 values. Drawn split after split, the later ones would get the rarer,
    harder two-digit problems; dealt from one set, every split has the same share."""
    t = task(min_digits=1, max_digits=2, operations=("*",), eval_size=1000, validation_size=1000, train_size=2000)
    share = lambda problems: np.mean([p.a < 10 or p.b < 10 for p in problems])  # noqa: E731
    test, val, pool = share(t.eval_problems), share(t.validation_problems), share(t._pool.items)
    assert abs(test - val) < 0.05 and abs(test - pool) < 0.05, (test, val, pool)


def test_a_finite_pool_is_visited_once_per_epoch_in_an_order_set_by_the_run_seed():
    t = task(min_digits=2, max_digits=2, eval_size=64, validation_size=64, train_size=96)
    epoch = [p for i in range(12) for p in t.train_problems(seed=3, index=i, n=8)]
    assert sorted(epoch, key=str) == sorted(t._pool.items, key=str)  # 12 x 8 = one epoch: each problem once
    second = [p for i in range(12, 24) for p in t.train_problems(seed=3, index=i, n=8)]
    assert set(second) == set(epoch) and second != epoch  # the next epoch: the same problems, reshuffled
    assert t.train_problems(3, 5, 8) == task(min_digits=2, max_digits=2, eval_size=64, validation_size=64,
                                             train_size=96).train_problems(3, 5, 8)  # a pure function
    assert [p for i in range(12) for p in t.train_problems(seed=4, index=i, n=8)] != epoch
    held_out = set(t.eval_problems) | set(t.validation_problems)
    assert not held_out & set(epoch)


def test_the_endless_stream_never_draws_a_validation_problem():
    t = task(min_digits=1, max_digits=1, eval_size=20, validation_size=20)
    drawn = {p for i in range(50) for p in t.train_problems(0, i, 16)}
    assert not drawn & (set(t.eval_problems) | set(t.validation_problems))


@pytest.mark.parametrize("overrides, key", [
    (["task.operations=['+','*']"], "task.scratchpad"),
    (["sampling.max_new_tokens=48"], "sampling.max_new_tokens"),
    (["task.train_size=998000"], "task.train_size"),
    (["task.validation_size=998200"], "task.eval_size"),
])
def test_product_scratchpad_and_split_sizes_are_validated_by_the_task(overrides, key):
    from jaxreplay.config import ConfigError, load_config

    base = ["task.scratchpad=true", "task.operations=['*']", "task.min_digits=3", "task.max_digits=3",
            "model.max_seq_len=64", "sampling.max_new_tokens=49", "task.eval_size=1024"]
    load_config(None, base)
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        load_config(None, base + overrides)
