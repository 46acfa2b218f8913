"""reasoning-gym's generators as a task (`task.name: reasoning_gym`, tasks/procedural.py): three
disjoint splits fixed by task.data_seed, a reward of 1 only for an exact answer, a training pool
visited in epochs, one-line config errors naming the key, and a run and its evaluation end to end.

The reasoning_gym extra is not in `test` (pycosat builds from source with a C compiler): where it
is missing these tests skip; CI's default lane installs it (.ci/run) and --lane-check fails a skip."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxreplay.cli import main
from jaxreplay.config import ConfigError, load_config
from jaxreplay.tasks.base import ByteTokenizer
from jaxreplay.tasks.datasets import DatasetError
from jaxreplay.tasks.procedural import SPLIT_STRIDE, extract_answer, split_seed
from jaxreplay.tasks.registry import make_task

pytestmark = pytest.mark.needs_reasoning_gym

ROOT = Path(__file__).resolve().parents[1]
# Products of two 1-digit numbers: 100 distinct questions, so the generator repeats itself within a split.
SMALL = ["task.name=reasoning_gym", "task.dataset=products", "task.dataset_config.min_digits=1",
         "task.dataset_config.max_digits=1", "warmstart.steps=0", "model.vocab_size=259", "task.max_prompt_len=96",
         "model.max_seq_len=112", "sampling.max_new_tokens=16"]


def config(*overrides):
    return load_config(None, [*SMALL, *overrides])


def task_of(*overrides, train=True):
    return make_task(config(*overrides).task, train=train)


@pytest.fixture
def base(tmp_path) -> str:
    """A config file of defaults, for the commands that take one."""
    (tmp_path / "base.yaml").write_text("{}\n")
    return str(tmp_path / "base.yaml")


def ids(text: str) -> list[int]:
    tok = ByteTokenizer()
    return tok.encode(text) + [tok.eos_id]


# -- splits ----------------------------------------------------------------------------------------

def test_the_three_splits_are_disjoint_even_where_the_generator_repeats_itself():
    task = task_of("task.eval_size=30", "task.validation_size=20", "task.train_size=40")
    test, validation, train = ([p.prompt for p in split] for split in
                               (task.eval_problems, task.validation_problems, task.train_examples))
    assert (len(test), len(validation), len(train)) == (30, 20, 40)
    assert len(set(test)) == 30 and len(set(validation)) == 20 and len(set(train)) == 40  # distinct within
    assert not set(test) & set(validation) and not set(test) & set(train) and not set(validation) & set(train)


def test_splits_are_fixed_by_data_seed_and_drawn_from_seeds_far_apart():
    sizes = ("task.eval_size=8", "task.validation_size=8", "task.train_size=8", "task.dataset_config.max_digits=3")
    a, b = task_of(*sizes), task_of(*sizes)
    other = task_of(*sizes, "task.data_seed=99")
    for split in ("eval_problems", "validation_problems", "train_examples"):
        assert getattr(a, split) == getattr(b, split)
        assert getattr(a, split) != getattr(other, split)
    seeds = [split_seed(config().task, s) for s in ("test", "validation", "train")]
    assert all(later - earlier == SPLIT_STRIDE > 2**24 * 4 for earlier, later in zip(seeds, seeds[1:]))


def test_the_seed_after_data_seed_shares_items_which_is_why_splits_are_strided():
    """The pitfall the strides avoid: item i is drawn with Random(seed + i)."""
    import reasoning_gym

    first = reasoning_gym.create_dataset("products", seed=100, size=50, max_digits=3)
    second = reasoning_gym.create_dataset("products", seed=101, size=50, max_digits=3)
    assert [first[i + 1]["question"] for i in range(49)] == [second[i]["question"] for i in range(49)]


def test_too_few_distinct_questions_for_the_splits_is_an_error_naming_the_split():
    with pytest.raises(DatasetError, match=r"only \d+ distinct train questions .* 90 asked"):
        task_of("task.eval_size=30", "task.validation_size=10", "task.train_size=90")


def test_train_size_0_pools_2048_problems_and_evaluation_draws_none():
    task = task_of("task.dataset_config.max_digits=3", "task.eval_size=4")
    assert len(task.train_examples) == 2048
    held_out = task_of("task.dataset_config.max_digits=3", "task.eval_size=4", train=False)
    assert held_out.eval_problems == task.eval_problems and held_out.train_examples == []
    with pytest.raises(RuntimeError, match="evaluation only"):
        held_out.train_problems(0, 0, 4)


def test_the_training_pool_is_visited_in_epochs_in_a_seeded_order():
    task = task_of("task.eval_size=4", "task.train_size=12")
    assert task.train_problems(0, 2, 4) == task.train_problems(0, 2, 4)
    stream = [p.prompt for i in range(6) for p in task.train_problems(7, i, 4)]  # 24 draws: two epochs
    pool = sorted(p.prompt for p in task.train_examples)
    assert sorted(stream[:12]) == sorted(stream[12:]) == pool
    assert stream[:12] != stream[12:]  # a fresh order each epoch
    assert [p.prompt for i in range(3) for p in task.train_problems(8, i, 4)] != stream[:12]  # run.seed's order


def test_prompts_go_through_the_template_left_padded():
    task = task_of("task.eval_size=2", "task.train_size=4", "task.max_prompt_len=128", "model.max_seq_len=144",
                   r"task.prompt_template={prompt} Answer in <answer></answer>.")
    tokens, mask = task.encode_prompts(task.eval_problems)
    p = task.eval_problems[0]
    assert tokens[0][mask[0]].tolist() == [ByteTokenizer.BOS] + ByteTokenizer().encode(
        f"{p.prompt} Answer in <answer></answer>.")
    assert tokens.shape == (2, 128) and not mask[0][0]


# -- reward ----------------------------------------------------------------------------------------

def test_the_reward_is_1_only_for_the_exact_answer_never_partial_credit():
    task = task_of("task.eval_size=4", "task.train_size=4", "task.dataset_config.min_digits=3",
                   "task.dataset_config.max_digits=3")
    p = task.eval_problems[0]
    entry = task._entries[p.prompt]
    assert task.reward(p, ids(p.answer)) == 1.0
    assert task.reward(p, ids(f"  {p.answer}\n")) == 1.0
    assert task.reward(p, ids(f"thinking... <answer>{p.answer}</answer>")) == 1.0
    assert task.reward(p, ids(f"<answer>1</answer> no, <answer>{p.answer}</answer>")) == 1.0  # the last one
    longer = f"the answer is {p.answer}"
    assert 0 < task.generator.score_answer(longer, entry) < 1  # reasoning-gym's partial credit...
    assert task.reward(p, ids(longer)) == 0.0  # ...is not a reward
    assert task.reward(p, ids(f"<answer>{longer}</answer>")) == 0.0
    assert task.reward(p, ids(f"<answer>{p.answer}</answer> <answer>7</answer>")) == 0.0
    assert task.reward(p, ids("")) == 0.0
    assert task.reward(p, ids(p.answer)[:-1] + ids("0")) == 0.0  # a digit more


def test_the_answer_is_the_last_answer_tag_else_the_whole_completion():
    assert extract_answer("a <answer> 12 </answer> b <answer>\n34\n</answer> c") == "34"
    assert extract_answer("  56 \n") == "56"
    assert extract_answer("<answer>unclosed 7") == "<answer>unclosed 7"


# -- config ----------------------------------------------------------------------------------------

def test_config_flat_prints_the_settings_as_overrides_that_read_back(base, capsys):
    assert main(["config", base, "--flat", *SMALL]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "task.dataset_config.min_digits: 1" in lines and "task.dataset: products" in lines
    again = load_config(None, [line.replace(": ", "=", 1) for line in lines])
    assert again == config()


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["task.dataset=prodcts"], "task.dataset: 'prodcts' is not a reasoning-gym generator (did you mean products?)"),
        (["task.dataset=zzzzqq"], "task.dataset: 'zzzzqq' is not a reasoning-gym generator (e.g. products, chain_sum"),
        (["task.dataset=null"], "task.dataset: task.name=reasoning_gym needs a generator's name"),
        (["task.dataset_config.max_digitz=3"], "task.dataset_config.max_digitz: not a setting of products (its "
                                               "settings: min_terms, max_terms, min_digits, max_digits"),
        (["task.dataset_config.min_digits=0"], "task.dataset_config: products rejects these settings: AssertionError: "
                                               "min_digits must be positive"),
        (["task.dataset_config.min_digits=abc"], "task.dataset_config: products rejects these settings: TypeError"),
        (["task.dataset_config.seed=3"], "task.dataset_config.seed: is set by this task"),
        (["task.dataset_config=3"], "task.dataset_config: expected a mapping, got int 3"),
        (["warmstart.steps=10"], "warmstart.steps: the reasoning_gym task has no supervised demonstrations"),
        (["task.reward=exact_match"], "task.reward: must be null for reasoning_gym"),
        (["task.eval_split=validation"], "task.eval_split: reasoning_gym's splits are test, validation and train"),
        (["task.train_size=20000000"], "task.train_size: at most 16777216 problems a split"),
        (["task.name=arithmetic", "model.vocab_size=32"], "task.dataset: is for task.name=reasoning_gym only"),
    ],
)
def test_bad_settings_are_one_config_error_line_naming_the_key(overrides, line, base, capsys):
    assert main(["config", base, *SMALL, *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxreplay: config error: {line}") and err.count("\n") == 1, err


def test_without_reasoning_gym_installed_the_config_error_says_what_to_install(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "reasoning_gym" else
                        find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"task.name: reasoning_gym needs reasoning-gym \(pip install "
                                          r"'jaxreplay\[reasoning_gym\]'; pycosat.*C compiler"):
        config()


# -- end to end ------------------------------------------------------------------------------------

TINY_RUN = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
            "model.d_ff=64", "task.eval_size=8", "task.validation_size=8", "task.train_size=32",
            "train.batch_size=16", "train.prompts_per_step=4", "train.group_size=4", "train.steps=2",
            "train.eval_every=2", "replay.max_size=64", "replay.min_size_to_sample=16", "checkpoint.every=2",
            "run.progress_bar=false", "sampling.max_new_tokens=4", "model.max_seq_len=100"]


@pytest.mark.slow
def test_train_and_eval_run_end_to_end_on_a_generator(tmp_path, base):
    """`jaxreplay train` on a tiny byte-level model with no warm start, scored on both held-out splits,
    then `jaxreplay eval` of its checkpoint on the test split."""
    from jaxreplay.train.metrics import read_metrics

    run_dir = tmp_path / "run"
    args = [*SMALL, *TINY_RUN, f"run.dir={run_dir}"]
    result = subprocess.run([sys.executable, "-m", "jaxreplay", "train", base, *args], capture_output=True, text=True,
                            timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    for key in ("eval/accuracy", "eval/validation_accuracy"):
        assert 0.0 <= records[-1][key] <= 1.0 and key in records[0]
    out = tmp_path / "eval.json"
    result = subprocess.run([sys.executable, "-m", "jaxreplay", "eval", str(run_dir), "--out", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    scores = json.loads(out.read_text())
    assert scores["task"] == "reasoning_gym" and scores["split"] == "test" and 0.0 <= scores["pass@1_t0.1"] <= 1.0
