"""`jaxreplay sweep`: the grid, its validation, skipping finished runs and resuming the rest."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jaxreplay.config import ConfigError
from jaxreplay.research.sweep import commands, load_sweep, run_sweep

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


def _write(tmp_path, body: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(f"base: {DEMO}\nout: {tmp_path / 'runs'}\n" + body)
    return path


def test_the_committed_demo_sweep_is_4_settings_by_3_seeds():
    sweep = load_sweep(DEMO.parent / "sweep_demo.yaml")
    grid = {(r.setting, r.seed) for r in sweep.runs}
    assert grid == {(s, seed) for s in ("on_policy", "spi2", "spi4", "spi8") for seed in (0, 1, 2)}
    spi = {r.setting: (r.config.replay.mode, r.config.replay.samples_per_insert) for r in sweep.runs}
    assert spi["on_policy"][0] == "on_policy" and spi["spi8"] == ("replay", 8.0)


def test_the_testbed_sweep_covers_the_replay_runs_compute_at_the_papers_mu_and_declares_its_claims():
    sweep = load_sweep(DEMO.parent / "sweep_testbed.yaml")
    assert {(r.setting, r.seed) for r in sweep.runs} == {
        (s, seed) for s in ("on_policy", *(f"spi{y}_nr{n}" for y in (2, 4, 8) for n in (2, 16))) for seed in range(5)}
    budget = {r.setting: r.config.train.max_generated_tokens for r in sweep.runs}
    spi = {r.setting: r.config.replay.samples_per_insert for r in sweep.runs if r.config.replay.mode == "replay"}
    for mu in (5.28, 6.84):  # on-policy spends 1 + mu per generated rollout, replay y + mu
        assert budget["on_policy"] >= (max(spi.values()) + mu) / (1 + mu) * \
            max(v for k, v in budget.items() if k != "on_policy")
    assert all(r.config.task.eval_size >= 1024 for r in sweep.runs)
    assert "moderate_reuse_keeps_peak" in sweep.claims


def test_command_line_overrides_apply_to_every_run_after_the_files_own(tmp_path):
    path = _write(tmp_path, "seeds: [0, 1]\noverrides: [train.steps=7]\nsettings:\n  a: [train.batch_size=32]\n")
    sweep = load_sweep(path, ["train.steps=9", "train.batch_size=16"])
    assert {(r.config.train.steps, r.config.train.batch_size) for r in sweep.runs} == {(9, 16)}
    assert all("train.steps=9" in c for c in commands(sweep))
    with pytest.raises(ConfigError, match="run.seed and run.dir are set by the sweep"):
        load_sweep(path, ["run.seed=3"])
    out = subprocess.run([sys.executable, "-m", "jaxreplay.cli", "sweep", str(path), "train.steps=11", "--print"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert all("train.steps=11" in line for line in out.stdout.splitlines())


def test_grid_is_settings_times_seeds_seed_by_seed_with_one_command_each(tmp_path):
    sweep = load_sweep(_write(tmp_path, "seeds: [3, 4]\noverrides: [train.steps=7]\nsettings:\n"
                                        "  a: [replay.samples_per_insert=4]\n  b: [replay.mode=on_policy]\n"))
    assert [(r.setting, r.seed, r.config.train.steps) for r in sweep.runs] == \
        [("a", 3, 7), ("b", 3, 7), ("a", 4, 7), ("b", 4, 7)]
    assert sweep.runs[2].dir == tmp_path / "runs" / "a" / "seed4"
    cmds = commands(sweep)
    assert len(cmds) == 4
    assert shlex.split(cmds[2])[:3] == ["jaxreplay", "train", str(DEMO)]
    assert "replay.samples_per_insert=4" in cmds[2] and "run.seed=4" in cmds[2]


def test_seeds_splits_a_sweep_over_cores_or_machines(tmp_path):
    path = _write(tmp_path, "seeds: [0, 1, 2]\nsettings:\n  a: []\n  b: [replay.mode=on_policy]\n")
    assert [(r.setting, r.seed) for r in load_sweep(path, only_seeds=(2, 0)).runs] == \
        [("a", 0), ("b", 0), ("a", 2), ("b", 2)]
    with pytest.raises(ConfigError, match="--seeds: 5 is not one of the sweep's seeds"):
        load_sweep(path, only_seeds=(5,))
    out = subprocess.run([sys.executable, "-m", "jaxreplay.cli", "sweep", str(path), "--seeds", "1", "--print"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [shlex.split(line)[-3] for line in out.stdout.splitlines()] == ["run.seed=1"] * 2
    bad = subprocess.run([sys.executable, "-m", "jaxreplay.cli", "sweep", str(path), "--seeds", "one"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "expected integers separated by commas" in bad.stderr


def test_every_setting_shares_one_warm_start_unless_the_sweep_names_another(tmp_path):
    body = "seeds: [0, 1]\nsettings:\n  a: [replay.samples_per_insert=4]\n  b: [replay.mode=on_policy]\n"
    sweep = load_sweep(_write(tmp_path, body))
    assert {r.config.warmstart.cache_dir for r in sweep.runs} == {str(tmp_path / "runs" / ".warmstart-cache")}
    own = load_sweep(_write(tmp_path, body), [f"warmstart.cache_dir={tmp_path / 'cache'}"])
    assert {r.config.warmstart.cache_dir for r in own.runs} == {str(tmp_path / "cache")}


@pytest.mark.parametrize("body,key", [
    ("seeds: [0]\nsettings:\n  a: [replay.samples_per_insert=-1]\n", "sweep.settings.a"),
    ("seeds: [0]\nsettings:\n  a: [replay.selectr=fifo]\n", "replay.selectr"),
    ("seeds: [0, 0]\nsettings:\n  a: []\n", "sweep.seeds"),
    ("seeds: [0]\nsettings:\n  a: [run.seed=3]\n", "sweep.settings.a"),
    ("seeds: [0]\nsettings:\n  a/b: []\n", "sweep.settings"),
    ("seeds: [0]\n", "sweep.settings"),
    ("seeds: [0]\nsettings:\n  a: []\nretries: 3\n", "retries"),
])
def test_a_bad_sweep_is_refused_before_any_run_starts(tmp_path, body, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_sweep(_write(tmp_path, body))
    assert not (tmp_path / "runs").exists()


def test_finished_runs_are_skipped(tmp_path):
    sweep = load_sweep(_write(tmp_path, "seeds: [0]\noverrides: [train.steps=5]\nsettings:\n  a: []\n"))
    (run,) = sweep.runs
    run.dir.mkdir(parents=True)
    (run.dir / "summary.json").write_text(json.dumps({"steps": 5}))
    assert run_sweep(sweep, log=lambda _: None) == {str(run.dir): "skipped"}
    (run.dir / "summary.json").write_text(json.dumps({"steps": 3}))  # fewer steps than asked: unfinished
    assert not run.is_done()


def test_a_run_that_spent_its_token_budget_is_finished(tmp_path):
    body = "seeds: [0]\noverrides: [train.steps=500, train.max_generated_tokens=1000]\nsettings:\n  a: []\n"
    (run,) = load_sweep(_write(tmp_path, body)).runs
    run.dir.mkdir(parents=True)
    (run.dir / "summary.json").write_text(json.dumps({"steps": 40, "tokens/generated": 999}))
    assert not run.is_done()
    (run.dir / "summary.json").write_text(json.dumps({"steps": 41, "tokens/generated": 1010}))
    assert run.is_done()


@pytest.mark.slow
def test_sweep_runs_then_resumes_a_run_extended_to_more_steps(tmp_path):
    small = ("overrides: [warmstart.steps=2, train.eval_every=2, checkpoint.every=2, replay.min_size_to_sample=32, "
             "task.eval_size=16, model.d_model=32, model.n_layers=1, model.n_heads=2, model.n_kv_heads=1, "
             "model.head_dim=16, model.d_ff=64, train.batch_size=16, train.prompts_per_step=4, train.group_size=4, "
             "replay.max_size=64, train.steps={steps}]\nseeds: [0]\nsettings:\n  spi2: []\n")
    path = _write(tmp_path, small.format(steps=2))
    cli = [sys.executable, "-m", "jaxreplay.cli", "sweep", str(path)]
    first = subprocess.run(cli, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "starting" in first.stdout and "done" in first.stdout
    again = subprocess.run(cli, capture_output=True, text=True, timeout=600)
    assert "skipped" in again.stdout
    path.write_text(path.read_text().replace("train.steps=2", "train.steps=4"))
    longer = subprocess.run(cli, capture_output=True, text=True, timeout=600)
    assert longer.returncode == 0 and "resuming" in longer.stdout, longer.stdout + longer.stderr
    run_dir = tmp_path / "runs" / "spi2" / "seed0"
    assert "resumed from step 2" in (run_dir / "train.log").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4
