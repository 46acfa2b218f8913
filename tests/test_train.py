"""End-to-end: real training runs through a real Reverb server, real Orbax checkpoints, resume."""

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from jaxreplay.config import load_config
from jaxreplay.learn.learner import make_optimizer
from jaxreplay.models.transformer import init_params
from jaxreplay.replay.tables import resolve_backend
from jaxreplay.rollout.rollouts import row_spec
from jaxreplay.tasks.registry import make_task
from jaxreplay.train.checkpoint import Checkpointer
from jaxreplay.train.driver import train
from jaxreplay.train.metric_keys import KEYS as DOCUMENTED_KEYS
from jaxreplay.train.metrics import read_metrics
from jaxreplay.train.run import checkpoint_tree

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"

# The demo's shapes, shrunk: a one-layer model, 16 rollouts per actor step, batches of 16.
TINY = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
    "model.d_ff=64", "task.max_digits=2", "task.eval_size=32", "warmstart.steps=10",
    "train.batch_size=16", "train.prompts_per_step=4", "train.group_size=4", "train.eval_every=4",
    "replay.max_size=64", "replay.min_size_to_sample=32", "checkpoint.every=4", "run.progress_bar=false",
]

# One-digit sums after a longer warm start: rewards are mixed, so every step moves the params.
LEARNING = ["task.min_digits=1", "task.max_digits=1", "warmstart.steps=300", "warmstart.learning_rate=3e-3"]

REQUIRED_KEYS = {
    "step", "loss", "reward_mean", "accuracy", "entropy", "pg_clipfrac", "approx_kl", "grad_norm", "learning_rate",
    "replay/size", "replay/inserts", "replay/samples", "replay/ratio", "staleness/mean", "staleness/max",
    "tokens/generated", "tokens/trained", "time/generate_s", "time/train_s",
}


def run(tmp_path, *overrides, name="run"):
    config = load_config(DEMO, [*TINY, f"run.dir={tmp_path / name}", *overrides])
    return config, train(config, log=lambda _: None)


@pytest.mark.tier
@pytest.mark.slow
def test_short_run_logs_every_step_and_respects_the_limiter(tmp_path):
    config, summary = run(tmp_path, "train.steps=8")
    records = read_metrics(config.run.dir)
    assert [r["step"] for r in records] == list(range(9))  # step 0 is the warm-start eval
    for r in records:  # the metrics reference (docs/reference/metrics.md) lists every key a run writes
        assert r.keys() <= DOCUMENTED_KEYS, f"add to jaxreplay/train/metric_keys.py: {r.keys() - DOCUMENTED_KEYS}"
    for r in records[1:]:
        assert REQUIRED_KEYS <= r.keys(), REQUIRED_KEYS - r.keys()
        assert 0 <= r["staleness/mean"] <= r["staleness/max"] <= r["policy_version"]
        assert r["replay/size"] <= config.replay.max_size
        # The table never runs ahead of the limiter window (D = inserts*spi - samples).
        diff = r["replay/inserts"] * config.replay.samples_per_insert - r["replay/samples"]
        offset = config.replay.samples_per_insert * config.replay.min_size_to_sample
        assert abs(diff - offset) <= config.error_buffer
    assert "eval/accuracy" in records[0] and "eval/accuracy" in records[4] and "eval/accuracy" in records[8]
    assert records[-1]["replay/samples"] == 8 * config.train.batch_size
    assert records[-1]["tokens/trained"] > 0 and records[-1]["tokens/generated"] > 0
    assert summary["steps"] == 8
    assert json.loads((Path(config.run.dir) / "summary.json").read_text()) == summary
    assert list((Path(config.run.dir) / "tensorboard").glob("events.out.tfevents.*"))
    assert (Path(config.run.dir) / "config.yaml").exists()


@pytest.mark.tier
@pytest.mark.slow
def test_resume_continues_exactly_where_the_checkpoint_left_off(tmp_path):
    """2 steps, then the same command with train.steps=8, equals 8 steps straight.

    FIFO sampling makes Reverb deterministic (a 16-item window keeps the oldest item
    changing), so any difference in restored params,
    optimizer state, limiter counters, table contents or waiting rollouts would show.
    The narrow limiter window admits only a few of each actor step's 16 rollouts at a
    time, so the checkpoint at step 2 holds 9 generated rollouts still waiting. Prompts
    come from a pool of 8 (task.train_size) that 2 actor steps visit once, so the runs cross
    an epoch; every evaluation scores the validation split beside the test split.
    """
    # AsymRE's advantage r - (V + dV) is never zero, so every step moves the params even when a
    # 4-row FIFO batch holds one group with equal rewards (GRPO's advantage is 0 there).
    deterministic = ["replay.selector=fifo", "train.batch_size=4", "replay.samples_per_insert=1",
                     "replay.error_buffer=3", "replay.max_size=16", "replay.min_size_to_sample=16", *LEARNING,
                     "train.loss=asymre", "train.advantage=group_centered", "task.train_size=8",
                     "task.validation_size=8", "task.eval_size=8"]
    straight_config, straight = run(tmp_path, *deterministic, "train.steps=8", name="straight")
    run(tmp_path, *deterministic, "train.steps=2", name="resumed")
    resumed_config, resumed = run(tmp_path, *deterministic, "train.steps=8", name="resumed")

    a, b = read_metrics(straight_config.run.dir), read_metrics(resumed_config.run.dir)
    assert [r["step"] for r in b] == list(range(9))
    for ra, rb in zip(a, b):
        for key in ("loss", "grad_norm", "replay/size", "replay/inserts", "replay/samples", "staleness/mean",
                    "tokens/generated", "tokens/trained", "eval/accuracy", "eval/validation_accuracy"):
            if key in ra and key in rb:  # the first leg also evaluated at its last step
                assert ra[key] == pytest.approx(rb[key], rel=1e-6), (ra["step"], key)
    assert sum(r["grad_norm"] > 0 for r in a[1:]) >= 3, "the runs must actually learn for this to test anything"
    assert a[-1]["rollouts/generated"] > 2 * 16  # past the pool's first epoch
    evaluated = [r for r in a if "eval/accuracy" in r]
    assert [r["step"] for r in evaluated] == [0, 4, 8] and all("eval/validation_accuracy" in r for r in evaluated)
    assert not any("eval/validation_accuracy" in r for r in a if "eval/accuracy" not in r)

    task = make_task(straight_config.task)
    graphdef, params = init_params(straight_config.model, 0)
    like = checkpoint_tree(params, make_optimizer(straight_config.train).init(params), None,
                  row_spec(straight_config, task.prompt_len), straight_config.rollouts_per_step)
    states = [Checkpointer(Path(c.run.dir) / "checkpoints", keep=2).restore(like) for c in
              (straight_config, resumed_config)]
    (state_a, progress_a), (state_b, progress_b) = states
    assert progress_a.learner_step == progress_b.learner_step == 8
    assert progress_a.policy_version == progress_b.policy_version == 8
    assert progress_a.actor_step == progress_b.actor_step
    for x, y in zip(jax_leaves(state_a), jax_leaves(state_b)):
        np.testing.assert_array_equal(x, y)


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# FIFO sampling through a narrow window (the oldest item keeps changing): deterministic on Reverb.
# Batches of two groups: with one, a group whose rollouts all score alike leaves a step
# without gradient, and seed 0 had 7 of 8 such steps.
NARROW_FIFO = ["replay.selector=fifo", "train.batch_size=8", "replay.samples_per_insert=1", "replay.error_buffer=5",
               "replay.max_size=16", "replay.min_size_to_sample=16"]


@pytest.mark.slow
@pytest.mark.parametrize("backend, selector", [("inprocess", ["replay.selector=uniform"]),
                                             pytest.param("reverb", NARROW_FIFO, marks=pytest.mark.needs_reverb)],
                         ids=["inprocess-uniform", "reverb-fifo"])
def test_two_runs_with_the_same_seed_are_identical(tmp_path, backend, selector):
    """The in-process server's selectors draw from a seed derived from run.seed; Reverb's
    uniform selector cannot be seeded, its fifo one needs no seed. The second run reuses
    the first one's warm start from the shared cache (deterministic, and not what this tests)."""
    if backend == "reverb":
        pytest.importorskip("reverb", reason="the reverb extra is not installed")
    settings = [f"replay.backend={backend}", *selector, "train.steps=8", *LEARNING]
    first, _ = run(tmp_path, *settings, name="first")
    second, _ = run(tmp_path, *settings, name="second")
    a, b = read_metrics(first.run.dir), read_metrics(second.run.dir)
    assert sum(r["grad_norm"] > 0 for r in a[1:]) >= 3, "the runs must actually learn for this to test anything"
    untimed = lambda record: {k: v for k, v in record.items() if not k.startswith(("time/", "cost/"))}
    for ra, rb in zip(a, b, strict=True):
        assert untimed(ra) == untimed(rb)


@pytest.mark.slow
def test_a_run_says_what_it_does_and_a_resume_what_it_resumed(tmp_path, capsys):
    """The backend `auto` chose is printed and recorded; the warm start shows a progress
    bar; a resume prints the latest evaluation, not the warm start's; summary.json's
    seconds count every invocation; an invocation that runs no step prints no "done"."""
    def leg(steps, *overrides):
        lines = []
        config = load_config(DEMO, [*TINY, f"run.dir={tmp_path}", f"train.steps={steps}",
                                    f"warmstart.cache_dir={tmp_path / 'cache'}", *overrides])  # computed here, once
        t0 = time.perf_counter()
        summary = train(config, log=lines.append)
        return lines, summary, time.perf_counter() - t0

    backend = resolve_backend("auto")
    lines, first, _ = leg(4, "run.progress_bar=true")
    assert lines[0] == f"replay backend: {backend} (replay.backend=auto)"
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["replay"]["backend"] == backend
    err = capsys.readouterr().err
    assert "warm start: 100%" in err
    assert "| 4/4 [" in err and "train: 5step" not in err  # the bar counts each learner step once
    assert any(line.startswith("eval/accuracy at start: ") for line in lines)

    lines, second, seconds = leg(8)
    latest, warm = read_metrics(tmp_path)[4]["eval/accuracy"], read_metrics(tmp_path)[0]["eval/accuracy"]
    assert f"eval/accuracy {latest:.3f} at the latest evaluation, resuming at step 4 ({warm:.3f} after the warm " \
        "start)" in lines
    assert not any(line.startswith("eval/accuracy at start") for line in lines)
    assert second["seconds"] > max(first["seconds"], seconds)  # both invocations, not the last one alone
    assert lines[-1].startswith("done: 8 steps")

    lines, third, _ = leg(8)
    assert not any(line.startswith("done:") for line in lines), lines
    assert third["seconds"] >= second["seconds"]


@pytest.mark.tier
@pytest.mark.slow
def test_resume_restores_the_table_the_checkpoint_named(tmp_path):
    config, _ = run(tmp_path, "train.steps=4")
    at_four = read_metrics(config.run.dir)[-1]
    # Resuming with the same step count does no work and reports the restored table.
    _, summary = run(tmp_path, "train.steps=4")
    assert summary["steps"] == 4
    assert summary["replay/inserts"] == at_four["replay/inserts"]
    assert summary["replay/samples"] == at_four["replay/samples"]


@pytest.mark.slow
@pytest.mark.parametrize("samples_per_insert", [1, 2, 4])
def test_measured_replay_ratio_matches_the_setting(tmp_path, samples_per_insert):
    """The demo's replay shapes (B = R = 64, min size 128, window 512) on a tiny model."""
    config, summary = run(
        tmp_path, f"replay.samples_per_insert={samples_per_insert}", "train.steps=100", "train.batch_size=64",
        "train.prompts_per_step=8", "train.group_size=8", "replay.max_size=512", "replay.min_size_to_sample=128",
        "train.eval_every=1000", "checkpoint.every=1000",
    )
    assert summary["replay/ratio"] == pytest.approx(samples_per_insert, rel=0.10)


def test_cli_rejects_a_bad_override_with_one_line_and_exit_code_2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "jaxreplay.cli", "train", str(DEMO), "train.stepz=3", f"run.dir={tmp_path}"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == "jaxreplay: config error: unknown key train.stepz " + lines[-1].split("train.stepz ", 1)[1]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.tier
@pytest.mark.slow
def test_checkpoints_are_pruned_together(tmp_path):
    """Orbax keeps `checkpoint.keep` steps; Reverb checkpoints no kept step names are deleted."""
    config, _ = run(tmp_path, "train.steps=12", "checkpoint.every=2", "checkpoint.keep=2")
    steps = sorted(int(p.name) for p in (Path(config.run.dir) / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [10, 12]
    replay = [p for p in (Path(config.run.dir) / "replay").iterdir() if not p.name.startswith(".")]
    assert len(replay) == 2 and all((p / "DONE").exists() for p in replay)


@pytest.mark.tier
@pytest.mark.slow
def test_cli_trains_and_keeps_native_logs_off_the_terminal(tmp_path):
    args = [f"{o}" for o in TINY] + ["train.steps=4", f"run.dir={tmp_path}"]
    result = subprocess.run([sys.executable, "-m", "jaxreplay.cli", "train", str(DEMO), *args],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "[reverb/cc" not in result.stderr and "[reverb/cc" not in result.stdout
    if importlib.util.find_spec("reverb") is not None:  # the in-process backend logs nothing natively
        assert "[reverb/cc" in (tmp_path / "native.log").read_text()
    assert result.stdout.strip().splitlines()[-1].startswith("done: 4 steps")


@pytest.mark.slow
def test_asking_for_no_more_steps_than_done_runs_nothing_and_says_why(tmp_path):
    """It used to print "done: 4 steps in 6.3s" as if it had trained."""
    config, _ = run(tmp_path, "train.steps=4")
    run_dir = Path(config.run.dir)
    kept = ("config.yaml", "metrics.jsonl", "summary.json")
    before = {name: (run_dir / name).read_bytes() for name in kept}
    for steps in (4, 2):
        result = subprocess.run([sys.executable, "-m", "jaxreplay.cli", "train", str(DEMO), *TINY,
                                 f"train.steps={steps}", f"run.dir={run_dir}"],
                                capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip().splitlines()[1:] == [  # after the version line
            f"nothing to run: no step ran, because the checkpoint in {run_dir / 'checkpoints'} is already at "
            f"step 4 >= train.steps={steps}; raise train.steps to train further"]
    assert {name: (run_dir / name).read_bytes() for name in kept} == before


def test_a_generated_token_budget_stops_the_run_and_sets_the_evaluation_cadence(tmp_path):
    """train.max_generated_tokens: settings compared at one inference budget stop at the first learner
    step once the actor has generated that many tokens; eval_every_tokens evaluates past each multiple."""
    config, summary = run(tmp_path, "train.steps=1000", "train.eval_every=1000", "train.max_generated_tokens=3000",
                          "train.eval_every_tokens=1000", "warmstart.steps=0")
    rows = read_metrics(config.run.dir)[1:]
    assert summary["stopped_by"] == "train.max_generated_tokens" and summary["steps"] < 1000
    assert rows[-1]["tokens/generated"] >= 3000 > rows[-2]["tokens/generated"]
    evaluated = [r["tokens/generated"] for r in rows if "eval/accuracy" in r]
    assert len(evaluated) == len({int(t // 1000) for t in evaluated}) >= 3  # once past each multiple, and at the end
