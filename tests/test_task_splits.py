"""`task.splits`: with `fixed` the warm start has a split of its own and no split moves when the
training pool's size changes (issue 49); `dealt`, pinned by the committed sweep files, is the
layout before it."""

from pathlib import Path

import pytest

from jaxreplay.config import ConfigError, TaskConfig, load_config
from jaxreplay.research.sweep import load_sweep
from jaxreplay.tasks.arithmetic import ArithmeticTask
from jaxreplay.train.warmstart import cache_key, warmstart_settings

ROOT = Path(__file__).resolve().parents[1]
# the multiplication testbed's digits: 10,000 distinct problems
MUL = dict(min_digits=1, max_digits=2, operations=("*",), scratchpad=True, eval_size=1024, validation_size=1024)


def task(**kw):
    return ArithmeticTask(TaskConfig(**kw))


def test_fixed_splits_do_not_move_with_the_pool_and_a_small_pool_is_the_start_of_the_full_one():
    full = task(**MUL, splits="fixed", warmstart_size=2000, train_size=2048)
    small = task(**MUL, splits="fixed", warmstart_size=2000, train_size=512)
    assert small.eval_problems == full.eval_problems
    assert small.validation_problems == full.validation_problems
    assert small.warmstart_problems == full.warmstart_problems
    assert small._pool.items == full._pool.items[:512]
    splits = [full.eval_problems, full.validation_problems, full.warmstart_problems, full._pool.items]
    assert [len(s) for s in splits] == [1024, 1024, 2000, 2048]
    assert len(set().union(*map(set, splits))) == sum(map(len, splits))  # disjoint and distinct
    # a smaller pool is a uniform sample of the larger one, not its easiest problems: the share of products with
    # a one-digit operand is within a few standard errors of the full pool's
    easy = [sum(p.a < 10 or p.b < 10 for p in ps) / len(ps) for ps in (small._pool.items, full._pool.items)]
    assert abs(easy[0] - easy[1]) < 0.06, easy


def test_the_warm_start_draws_from_its_own_split_and_training_never_does():
    t = task(**MUL, splits="fixed", warmstart_size=300, train_size=0)  # the endless stream
    warm = set(t.warmstart_problems)
    held_out = set(t.eval_problems) | set(t.validation_problems)
    tokens, _, _ = t.supervised_batch(seed=7, index=0, n=64, max_new_tokens=27)
    prompts = {tuple(row) for row in tokens[:, :t.prompt_len].tolist()}
    assert prompts <= {tuple(row) for row in t.encode_prompts(list(warm))[0].tolist()}
    drawn = [p for i in range(20) for p in t.train_problems(seed=7, index=i, n=64)]
    assert not (set(drawn) & (warm | held_out))


def test_dealt_is_the_old_layout_train_size_moves_the_test_split_and_the_warm_start_uses_the_pool():
    a, b = task(**MUL, train_size=2048), task(**MUL, train_size=512)
    assert a.eval_problems != b.eval_problems  # what issue 49 found: the pool's size moved the test split
    assert a.warmstart_problems == [] and TaskConfig().splits == "dealt"
    tokens, _, _ = b.supervised_batch(seed=7, index=0, n=64, max_new_tokens=27)
    pool = {tuple(row) for row in b.encode_prompts(b._pool.items)[0].tolist()}
    assert {tuple(row) for row in tokens[:, :b.prompt_len].tolist()} <= pool


def test_the_warm_start_cache_key_leaves_the_pool_out_with_fixed_splits_only(tmp_path):
    def key(*overrides):
        return cache_key(load_config(ROOT / "configs/testbed_mul.yaml", [f"run.dir={tmp_path}/r", *overrides]))

    assert key("task.splits=fixed", "task.train_size=512") == key("task.splits=fixed", "task.train_size=2048")
    assert key("task.train_size=512") != key("task.train_size=2048")
    assert key("task.splits=fixed", "task.warmstart_size=1000") != key("task.splits=fixed")
    assert key("task.splits=fixed") != key()
    # with `dealt` the settings are those of entries made before task.splits existed
    settings = warmstart_settings(load_config(ROOT / "configs/testbed_mul.yaml", [f"run.dir={tmp_path}/r"]))
    assert not {"splits", "warmstart_size"} & set(settings["task"])


def test_fixed_splits_must_fit_the_problems_they_are_dealt_from(tmp_path):
    with pytest.raises(ConfigError, match="task.train_size: .* do not fit the 7500 distinct problems"):
        load_config(ROOT / "configs/testbed_mul.yaml", ["task.splits=fixed", "task.train_size=4096"])
    with pytest.raises(ConfigError, match="task.warmstart_size: must be positive"):
        load_config(ROOT / "configs/testbed_mul.yaml", ["task.splits=fixed", "task.warmstart_size=0"])
    with pytest.raises(ConfigError, match="task.splits: is for task.name=arithmetic only"):
        load_config(None, ["task.name=jsonl", "task.path=data/{split}.jsonl", "task.splits=fixed",
                           "warmstart.steps=0"])


@pytest.mark.parametrize("name", ["sweep_mul_stage1.yaml", "sweep_mul_stage2.yaml", "sweep_testbed.yaml",
                                  "sweep_testbed_lr1e-4.yaml", "sweep_knobs.yaml",
                                  "sweep_demo.yaml", "sweep_demo_equal_tokens.yaml", "sweep_paper.yaml"])
def test_the_committed_sweeps_pin_the_old_layout(name, tmp_path):
    assert f"task.splits=dealt" in (ROOT / "configs" / name).read_text()
    sweep = load_sweep(ROOT / "configs" / name, only_seeds=None)
    assert {run.config.task.splits for run in sweep.runs} == {"dealt"}
