"""`jaxreplay sweep` in two stages: a stage-1 file runs every arm at each learning rate and
declares the rule that picks one; a stage-2 file names its stage 1 and may only run each arm at
the rate stage 1 chose."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jaxreplay.config import ConfigError
from jaxreplay.research.sweep import commands, load_sweep, run_sweep

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
STAGE1 = """seeds: [0, 1]
overrides: [train.steps=7]
learning_rates: [1e-3, 1e-4, 3.0e-4]
select: {measure: validation_peak, statistic: median}
settings:
  on_policy: [replay.mode=on_policy]
  spi4: [replay.samples_per_insert=4]
"""


def _write(tmp_path, body: str, name="sweep.yaml") -> Path:
    path = tmp_path / name
    path.write_text(f"base: {DEMO}\nout: {tmp_path / 'runs'}\n" + body)
    return path


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "jaxreplay.cli", "sweep", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def test_stage1_runs_every_arm_at_every_learning_rate_named_arm_lr(tmp_path):
    sweep = load_sweep(_write(tmp_path, STAGE1))
    expected = [(arm, lr, seed) for seed in (0, 1) for arm in ("on_policy", "spi4") for lr in (1e-4, 3e-4, 1e-3)]
    assert [(r.arm, r.config.train.learning_rate, r.seed) for r in sweep.runs] == expected
    assert [r.setting for r in sweep.runs[:3]] == ["on_policy.lr1e-4", "on_policy.lr3e-4", "on_policy.lr1e-3"]
    assert sweep.runs[4].dir == tmp_path / "runs" / "spi4.lr3e-4" / "seed0"
    assert {r.config.replay.mode for r in sweep.runs if r.arm == "on_policy"} == {"on_policy"}
    assert {r.config.train.steps for r in sweep.runs} == {7}
    assert sweep.select == {"measure": "validation_peak", "statistic": "median", "ties": "lower_lr"}
    line = shlex.split(commands(sweep)[1])  # the rate is in the command, hence in the run's config.yaml
    assert "train.learning_rate=0.0003" in line
    assert f"run.dir={tmp_path / 'runs' / 'on_policy.lr3e-4' / 'seed0'}" in line
    assert [(r.setting, r.seed) for r in load_sweep(_write(tmp_path, STAGE1), only_seeds=(1,)).runs] == \
        [(f"{arm}.lr{lr}", 1) for arm in ("on_policy", "spi4") for lr in ("1e-4", "3e-4", "1e-3")]
    out = _cli(_write(tmp_path, STAGE1), "--seeds", "1", "--print")
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 6, out.stderr


def test_stage1_may_give_each_arm_a_grid_of_its_own(tmp_path):
    """`learning_rates` as a mapping: each setting runs at its own rates, in the same folders."""
    body = STAGE1.replace("[1e-3, 1e-4, 3.0e-4]", "{on_policy: [2e-4, 1e-4], spi4: [2.5e-5, 5e-5, 1e-4]}")
    sweep = load_sweep(_write(tmp_path, body))
    assert [(r.setting, r.seed) for r in sweep.runs] == [
        (setting, seed) for seed in (0, 1) for setting in (
            "on_policy.lr1e-4", "on_policy.lr2e-4", "spi4.lr2.5e-5", "spi4.lr5e-5", "spi4.lr1e-4")]
    assert {r.config.train.learning_rate for r in sweep.runs if r.arm == "spi4"} == {2.5e-5, 5e-5, 1e-4}


@pytest.mark.parametrize("grids,message", [
    ("{on_policy: [1e-4]}", "sweep.learning_rates: no grid for the setting spi4"),
    ("{on_policy: [1e-4], spi4: [1e-4], spi8: [1e-4]}", "sweep.learning_rates: 'spi8' is not one of the settings"),
    ("{on_policy: [1e-4], spi4: []}", "sweep.learning_rates.spi4: expected a non-empty list"),
    ("{on_policy: [1e-4, 0.0001], spi4: [1e-4]}", "sweep.learning_rates.on_policy: repeated learning rate"),
])
def test_a_bad_per_arm_grid_is_refused_naming_the_arm(tmp_path, grids, message):
    with pytest.raises(ConfigError, match=message):
        load_sweep(_write(tmp_path, STAGE1.replace("[1e-3, 1e-4, 3.0e-4]", grids)))


def test_stage1_writes_its_rule_before_any_run(tmp_path):
    sweep = load_sweep(_write(tmp_path, STAGE1))
    for run in sweep.runs:  # all finished: the sweep skips them, but writes its rule first
        run.dir.mkdir(parents=True)
        (run.dir / "summary.json").write_text(json.dumps({"steps": run.config.train.steps}))
    assert set(run_sweep(sweep, log=lambda _: None).values()) == {"skipped"}
    assert yaml.safe_load((tmp_path / "runs" / "select.yaml").read_text()) == \
        {"measure": "validation_peak", "statistic": "median", "ties": "lower_lr"}


@pytest.mark.parametrize("edit,message", [
    (("select: {measure: validation_peak, statistic: median}\n", ""),
     "sweep.select: required with sweep.learning_rates"),
    (("learning_rates: [1e-3, 1e-4, 3.0e-4]\n", ""), "sweep.select: a selection rule needs sweep.learning_rates"),
    (("[1e-3, 1e-4, 3.0e-4]", "[1e-3, 0.001]"), "sweep.learning_rates: repeated learning rate"),
    (("[1e-3, 1e-4, 3.0e-4]", "[1e-3, -1]"), "sweep.learning_rates: expected a positive learning rate"),
    (("[1e-3, 1e-4, 3.0e-4]", "[]"), "sweep.learning_rates: expected a non-empty list"),
    (("statistic: median", "statistic: best"), "sweep.select.statistic: 'best' is not one of median, mean, iqm"),
    (("[replay.samples_per_insert=4]", "[replay.samples_per_insert=4, train.learning_rate=1e-3]"),
     "sweep.settings.spi4: train.learning_rate is set by sweep.learning_rates"),
    (("[train.steps=7]", "[train.steps=7, train.learning_rate=1e-3]"),
     "sweep.overrides: train.learning_rate is set by sweep.learning_rates"),
    (("settings:", "claims: {a: {settings: [spi4], measure: peak, above: 0}}\nsettings:"),
     "sweep.claims: stage 1 (sweep.learning_rates) only chooses learning rates"),
    (("spi4:", "spi4.lr2:"), "sweep.settings: spi4.lr2 holds '.lr'"),
])
def test_a_bad_stage1_file_is_refused_before_any_run(tmp_path, edit, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_sweep(_write(tmp_path, STAGE1.replace(*edit)))


def _stage2(tmp_path, settings: str, selected=None) -> Path:
    folder = tmp_path / "stage1_report"
    folder.mkdir(exist_ok=True)
    (folder / "selected.yaml").write_text(yaml.safe_dump(selected or {"on_policy": 3e-4, "spi4": 1e-3}))
    return _write(tmp_path, f"stage1: stage1_report\nseeds: [5, 6]\nsettings:\n{settings}", "stage2.yaml")


GOOD = "  on_policy: [replay.mode=on_policy, train.learning_rate=3e-4]\n  spi4: [train.learning_rate=0.001]\n"


def test_stage2_runs_each_arm_at_the_rate_stage1_chose(tmp_path):
    sweep = load_sweep(_stage2(tmp_path, GOOD))
    assert {(r.setting, r.config.train.learning_rate) for r in sweep.runs} == {("on_policy", 3e-4), ("spi4", 1e-3)}
    assert sweep.runs[0].dir == tmp_path / "runs" / "on_policy" / "seed5"  # the comparison's layout: SETTING/seedS


@pytest.mark.parametrize("settings,extra,message", [
    ("  on_policy: [replay.mode=on_policy, train.learning_rate=1e-3]\n  spi4: [train.learning_rate=0.001]\n", (),
     "sweep.settings.on_policy: train.learning_rate 1e-3 is not stage 1's choice for this arm (3e-4, "
     "stage1_report/selected.yaml)"),
    ("  on_policy: [replay.mode=on_policy]\n", (), "sweep.settings.on_policy: set train.learning_rate explicitly, "
                                                  "to stage 1's choice 3e-4"),
    (GOOD + "  spi8: [train.learning_rate=1e-3]\n", (), "sweep.settings.spi8: stage 1 selected no learning rate for "
                                                      "this arm (it selected: on_policy, spi4)"),
    (GOOD, ("train.learning_rate=1e-4",), "sweep.settings.on_policy: train.learning_rate 1e-4 is not stage 1's choice"),
])
def test_stage2_refuses_a_rate_or_an_arm_stage1_did_not_choose(tmp_path, settings, extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_sweep(_stage2(tmp_path, settings), extra)


def test_the_cli_refuses_either_stage_with_one_line_and_exit_2_before_any_run(tmp_path):
    stage1 = _write(tmp_path, STAGE1.replace("statistic: median", "statistic: best"))
    stage2 = _stage2(tmp_path, GOOD)
    for args, message in (((stage1,), "sweep.select.statistic: 'best' is not one of median, mean, iqm"),
                          ((stage2, "train.learning_rate=1e-4"), "sweep.settings.on_policy: train.learning_rate 1e-4 "
                                                                 "is not stage 1's choice for this arm (3e-4, ")):
        out = _cli(*args)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert out.stderr.startswith(f"jaxreplay: config error: {message}"), out.stderr
    assert not (tmp_path / "runs").exists()


def test_stage2_needs_its_stage1_selection(tmp_path):
    path = _write(tmp_path, f"stage1: nowhere\nseeds: [5]\nsettings:\n{GOOD}", "stage2.yaml")
    with pytest.raises(ConfigError, match="sweep.stage1: no selected.yaml in .*nowhere"):
        load_sweep(path)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "selected.yaml").write_text("on_policy: fast\n")
    path.write_text(path.read_text().replace("nowhere", "bad"))
    with pytest.raises(ConfigError, match="expected a positive learning rate like 3e-4, got 'fast'"):
        load_sweep(path)


def test_a_stage1_reports_selection_is_what_stage2_reads(tmp_path):
    """End to end without training: stage-1 run dirs -> `jaxreplay report` -> selected.yaml -> stage-2 check."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_report_stages import stage1_dirs

    from jaxreplay.research.report import report

    dirs = stage1_dirs(tmp_path / "s1")
    report(dirs, tmp_path / "stage1_report")
    path = _write(tmp_path, "stage1: stage1_report\nseeds: [5]\nsettings:\n  on_policy: [replay.mode=on_policy, "
                            "train.learning_rate=3e-4]\n  spi2: [train.learning_rate=1e-3]\n", "stage2.yaml")
    assert {r.config.train.learning_rate for r in load_sweep(path).runs} == {3e-4, 1e-3}
    path.write_text(path.read_text().replace("spi2: [train.learning_rate=1e-3]", "spi2: [train.learning_rate=3e-4]"))
    with pytest.raises(ConfigError, match="spi2: train.learning_rate 3e-4 is not stage 1's choice"):
        load_sweep(path)


def test_the_two_sweep_files_docs_comparing_shows_load(tmp_path):
    """docs/comparing.md's stage-1 and stage-2 examples, on the multiplication testbed: valid as written."""
    import re

    text = (DEMO.parents[1] / "docs" / "comparing.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)
    (first,) = [b for b in blocks if "learning_rates:" in b]
    (second,) = [b for b in blocks if "stage1:" in b]
    (selected,) = [b for b in blocks if b.startswith("on_policy: 0.0001")]
    (tmp_path / "results" / "mul_stage1").mkdir(parents=True)
    (tmp_path / "results" / "mul_stage1" / "selected.yaml").write_text(selected)
    (tmp_path / "configs").mkdir()
    for name, body in (("stage1.yaml", first), ("stage2.yaml", second)):
        (tmp_path / "configs" / name).write_text(body.replace("base: testbed_mul.yaml",
                                                              f"base: {DEMO.parent / 'testbed_mul.yaml'}"))
    stage1 = load_sweep(tmp_path / "configs" / "stage1.yaml")
    assert {r.setting for r in stage1.runs} == {f"{a}.lr{lr}" for a in ("on_policy", "spi4_nr16")
                                                for lr in ("5e-5", "1e-4", "2e-4", "4e-4")}
    stage2 = load_sweep(tmp_path / "configs" / "stage2.yaml")
    assert {r.setting: r.config.train.learning_rate for r in stage2.runs} == {"on_policy": 1e-4, "spi4_nr16": 5e-5}
    assert set(stage2.claims) == {"same_final_at_compute", "keeps_entropy", "falls_less"}


@pytest.mark.slow
def test_both_stages_run_end_to_end_on_the_multiplication_testbed(tmp_path):
    """Real runs, shrunk: stage 1 (two arms x two rates) -> its report picks each arm's rate on the
    validation split -> a stage-2 file at those rates -> its report with the frontier and the stage-1
    table. The committed stage-1 file's base and task are the ones used."""
    testbed = Path(__file__).resolve().parents[1] / "configs" / "testbed_mul.yaml"
    tiny = ("[model.d_model=32, model.n_layers=1, model.n_heads=2, model.n_kv_heads=1, model.head_dim=16, "
            "model.d_ff=64, warmstart.steps=20, task.eval_size=32, task.validation_size=32, task.train_size=64, "
            "train.batch_size=16, train.prompts_per_step=4, train.group_size=4, replay.max_size=64, "
            "replay.min_size_to_sample=32, train.steps=100, train.max_generated_tokens=2000, train.eval_every=100, "
            "train.eval_every_tokens=700, checkpoint.every=100]")
    arms = "settings:\n  on_policy: [replay.mode=on_policy{rate}]\n  spi2: [replay.mode=replay{rate}]\n"
    stage1 = tmp_path / "stage1.yaml"
    stage1.write_text(f"base: {testbed}\nout: {tmp_path / 'runs1'}\nseeds: [100]\noverrides: {tiny}\n"
                      "learning_rates: [1e-4, 1e-3]\nselect: {measure: validation_mean, statistic: median}\n"
                      + arms.format(rate=""))
    first = _cli(stage1, timeout=900)
    assert first.returncode == 0 and first.stdout.count("done in") == 4, first.stdout + first.stderr
    report = [sys.executable, "-m", "jaxreplay.cli", "report"]
    runs1 = sorted(str(p) for p in (tmp_path / "runs1").glob("*/seed100"))
    out = subprocess.run([*report, *runs1, "--out", str(tmp_path / "stage1")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    chosen = yaml.safe_load((tmp_path / "stage1" / "selected.yaml").read_text())
    assert set(chosen) == {"on_policy", "spi2"} and set(chosen.values()) <= {1e-4, 1e-3}

    rate = {arm: f", train.learning_rate={lr:g}" for arm, lr in chosen.items()}
    stage2 = tmp_path / "stage2.yaml"
    stage2.write_text(f"base: {testbed}\nout: {tmp_path / 'runs2'}\nstage1: stage1\nseeds: [0]\noverrides: "
                      f"{tiny}\nsettings:\n  on_policy: [replay.mode=on_policy{rate['on_policy']}]\n"
                      f"  spi2: [replay.mode=replay{rate['spi2']}]\n")
    second = _cli(stage2, timeout=900)
    assert second.returncode == 0 and second.stdout.count("done in") == 2, second.stdout + second.stderr
    runs2 = sorted(str(p) for p in (tmp_path / "runs2").glob("*/seed*"))
    out = subprocess.run([*report, *runs2, "--out", str(tmp_path / "stage2"), "--mu", "5.28", "--stage1", *runs1],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "stage2" / "report.md").read_text()
    assert "rontier" in text and "--stage1 stage1/*/*" in text
    assert list((tmp_path / "stage2").glob("frontier_mu*.png"))
    for run in runs2:  # every evaluation scored both held-out splits
        rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
        evaluated = [r for r in rows if "eval/accuracy" in r]
        assert len(evaluated) >= 3 and all("eval/validation_accuracy" in r for r in evaluated)
