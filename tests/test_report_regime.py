"""The exhaustion rule and the regime contrast (issue 49), on synthetic run records computed by hand.

Four settings, seeds 0-3: on-policy and replay on a small pool and on the full one. Every run logs
30 learner steps, 10 generated tokens a step, evaluations every 5 steps (test and validation) and
the fresh rollouts' training reward at every step. Half the budget is step 15: its 3 nearest
evaluations are steps 10, 15 and 20, the last 3 are 20, 25 and 30; its 10 nearest reward records
are steps 10-19, the last 10 are 21-30.
"""

import json

import pytest
import yaml

from jaxreplay.config import ConfigError
from jaxreplay.research.report import report
from jaxreplay.research.report_regime import Regime, parse_regime
from jaxreplay.research.sweep import load_sweep, run_sweep
from report_tables import markdown_tables
from test_replication import DEMO

EVALS = tuple(range(0, 31, 5))
PLATEAU = [0.2, 0.3, 0.44, 0.44, 0.44, 0.44, 0.44]  # last 3 mean 0.44, the 3 around half 0.44: gain 0
RISING = [0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5]  # last 3 0.45, around half 0.35: gain 0.1
FINAL = {  # seed -> final test accuracy of (on_policy_small, replay_small, on_policy_full, replay_full)
    0: (0.40, 0.45, 0.50, 0.46),  # (replay - on-policy) small 0.05, full -0.04: contrast 0.09
    1: (0.40, 0.43, 0.50, 0.46),  # 0.03 - (-0.04) = 0.07
    2: (0.40, 0.47, 0.50, 0.46),  # 0.07 - (-0.04) = 0.11
    3: (0.40, 0.41, 0.50, 0.46),  # 0.01 - (-0.04) = 0.05
}
SETTINGS = {"on_policy_small": ("on_policy", 512), "replay_small": ("replay", 512),
            "on_policy_full": ("on_policy", 2048), "replay_full": ("replay", 2048)}
CLAIMS = {
    "regime_contrast": {"text": "replay's edge is larger on the exhausted pool", "settings": ["replay_small"],
                        "baseline": "on_policy_small", "measure": "final", "above": 0.0, "regime": True,
                        "contrast": {"settings": ["replay_full"], "baseline": "on_policy_full"}},
    "small_final": {"text": "replay keeps the final accuracy on the small pool", "settings": ["replay_small"],
                    "baseline": "on_policy_small", "measure": "final", "above": -0.03, "regime": True},
    "full_final": {"text": "replay keeps the final accuracy on the full pool", "settings": ["replay_full"],
                   "baseline": "on_policy_full", "measure": "final", "above": -0.03},
}
REGIME = {"setting": "on_policy_small", "evaluations": 3, "plateau": 0.01, "reward_window": 10, "reward_rise": 0.1}


def _run(root, setting, seed, validation, final):
    mode, pool = SETTINGS[setting]
    d = root / setting / f"seed{seed}"
    d.mkdir(parents=True)
    config = {"replay": {"mode": mode, "samples_per_insert": 1.0 if mode == "on_policy" else 4.0, "max_size": 64},
              "task": {"train_size": pool}, "train": {"batch_size": 4, "prompts_per_step": 2, "group_size": 2},
              "run": {"seed": seed, "dir": str(d)}}
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    test = [0.2, *[0.3] * (len(EVALS) - 2), final]
    records = [{"step": 0, "eval/accuracy": test[0], "eval/validation_accuracy": validation[0]}]
    for step in range(1, 31):
        rec = {"step": step, "rollouts/generated": float(step), "rollouts/trained": 4.0 * step,
               "tokens/generated": 10.0 * step, "reward_mean": 0.2 + 0.02 * step}  # reward rise 0.71 - 0.49 = 0.22
        if step in EVALS:
            i = EVALS.index(step)
            rec["eval/accuracy"], rec["eval/validation_accuracy"] = test[i], validation[i]
        records.append(rec)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (d / "summary.json").write_text(json.dumps({"steps": 30}))
    return d


def _study(root, validation):
    dirs = [_run(root, name, seed, validation, FINAL[seed][i]) for seed in FINAL
            for i, name in enumerate(SETTINGS) if not (name == "replay_full" and seed == 3 and root.name == "gap")]
    (root / "claims.yaml").write_text(yaml.safe_dump(CLAIMS, sort_keys=False))
    (root / "regime.yaml").write_text(yaml.safe_dump(REGIME))
    return dirs


def test_the_regime_contrast_is_a_difference_of_paired_differences_decided_where_the_pool_was_exhausted(tmp_path):
    report(sorted(_study(tmp_path / "study", PLATEAU)), tmp_path / "out", baseline="on_policy_small")  # as a glob gives
    md = (tmp_path / "out" / "report.md").read_text()
    rows = markdown_tables(md)["Claims and verdicts"]
    contrast = rows["replay's edge is larger on the exhausted pool"]
    # per seed 0.09, 0.07, 0.11, 0.05: the IQM cuts one from each end, (0.07 + 0.09) / 2; every replicate is positive
    assert contrast["paired numbers"].startswith("IQM 0.08 [") and "over 4 paired seeds; above 0 in 4/4" in \
        contrast["paired numbers"]
    assert contrast["verdict"] == "holds"
    assert contrast["rule (declared in the sweep file)"] == \
        "paired IQM of (final − on_policy_small's) − (the same of replay_full − on_policy_full's) > 0"
    # each claim pairs with its own baseline: 0.05, 0.03, 0.07, 0.01 on the small pool; -0.04 four times on the full
    assert rows["replay keeps the final accuracy on the small pool"]["verdict"] == "holds"
    full = rows["replay keeps the final accuracy on the full pool"]
    assert full["paired numbers"].startswith("IQM -0.04 [-0.04 ±0, -0.04 ±0]")
    assert rows["replay keeps the final accuracy on the full pool"]["verdict"] == "fails"
    assert "Met: on_policy_small's validation rose 0 from half the budget to the end (at most 0.01) while its " \
           "training reward rose 0.22 (at least 0.1); median over 4 seeds" in md
    # on-policy's training reward beside its test accuracy: at half its tokens (step 15), 0.3 and 0.2 + 0.02 * 15
    reward = markdown_tables(md)["On-policy's training reward beside its test accuracy"]
    assert reward["on_policy_small"]["test accuracy at 50% of its tokens"] == "0.3 [0.3, 0.3]"
    assert reward["on_policy_small"]["training reward at 50% of its tokens"] == "0.5 [0.5, 0.5]"
    assert reward["on_policy_full"]["test accuracy at 100% of its tokens"] == "0.5 [0.5, 0.5]"
    assert "replay_small" not in reward
    # the report rebuilds from its copies, the rule and the claims with them
    copies = sorted(p for p in (tmp_path / "out" / "runs").glob("*/*") if p.is_dir())
    report(copies, tmp_path / "again", baseline="on_policy_small")
    assert (tmp_path / "again" / "report.md").read_text() == md


def test_where_on_policy_still_learns_the_regime_claims_are_regime_not_reached_with_the_numbers(tmp_path):
    root = tmp_path / "gap"  # on-policy's validation still rising; seed 3 has no replay_full run
    report(_study(root, RISING), tmp_path / "out", baseline="on_policy_small")
    rows = markdown_tables((tmp_path / "out" / "report.md").read_text())["Claims and verdicts"]
    why = ("regime not reached: on_policy_small's validation rose 0.1 from half the budget to the end (more than "
           "0.01) while its training reward rose 0.22 (at least 0.1); median over 4 seeds")
    contrast = rows["replay's edge is larger on the exhausted pool"]
    assert contrast["verdict"] == why
    assert "over 3 paired seeds" in contrast["paired numbers"]  # paired by seed: seed 3 lacks one of the four runs
    assert rows["replay keeps the final accuracy on the small pool"]["verdict"] == why
    assert rows["replay keeps the final accuracy on the full pool"]["verdict"] == "fails"  # not a regime claim


def test_two_baselines_split_the_report_into_pools_each_setting_paired_with_its_own_pools_baseline(tmp_path):
    study = tmp_path / "study"
    dirs = _study(study, PLATEAU)
    claims = {**CLAIMS, "full_final_own_pool": {**CLAIMS["full_final"], "text": "the same, its baseline left to its pool"}}
    del claims["full_final_own_pool"]["baseline"]
    (study / "claims.yaml").write_text(yaml.safe_dump(claims, sort_keys=False))
    both = "on_policy_small,on_policy_full"
    report(sorted(dirs), tmp_path / "out", baseline=both)
    md = (tmp_path / "out" / "report.md").read_text()
    small, full = md.split("## Pool of `on_policy_small`: task.train_size=512")[1].split(
        "## Pool of `on_policy_full`: task.train_size=2048")
    for text, base, other, mine, diff in ((small, "on_policy_small", "replay_full", "replay_small", "0.04 [0.025, 0.055]"),
                                          (full, "on_policy_full", "replay_small", "replay_full", "-0.04 [-0.04, -0.04]")):
        paired = markdown_tables(text)[f"Paired by seed: each run minus the {base} run of the same seed"]
        assert list(paired) == [mine]  # the other pool's settings are not paired with this baseline
        assert paired[mine][f"final − {base}'s"].startswith(diff + "; IQM")
        assert other not in markdown_tables(text)["Per setting"]
        assert f"![" in text and f"]({base}_accuracy_vs_tokens.png)" in text
        assert (tmp_path / "out" / f"{base}_accuracy_vs_tokens.png").exists()
    assert not (tmp_path / "out" / "accuracy_vs_tokens.png").exists()
    assert "`on_policy_small` for task.train_size=512 (on_policy_small, replay_small)" in md
    rows = markdown_tables(md)["Claims and verdicts"]
    own = rows["the same, its baseline left to its pool"]
    assert own["paired numbers"].startswith("IQM -0.04 [-0.04 ±0, -0.04 ±0]") and own["verdict"] == "fails"
    assert own["rule (declared in the sweep file)"] == "paired IQM of final − on_policy_full's > -0.03"
    assert f"`jaxreplay report runs/*/* --out . --baseline {both}`" in md
    copies = sorted(p for p in (tmp_path / "out" / "runs").glob("*/*") if p.is_dir())
    report(copies, tmp_path / "again", baseline=both)
    assert (tmp_path / "again" / "report.md").read_text() == md
    # settings that fit no pool, or baselines nothing tells apart, are refused before anything is written
    mid = study / "replay_mid" / "seed0"  # a third pool size, which neither baseline has
    mid.mkdir(parents=True)
    for f in ("metrics.jsonl", "summary.json"):
        (mid / f).write_text((study / "replay_small" / "seed0" / f).read_text())
    config = yaml.safe_load((study / "replay_small" / "seed0" / "config.yaml").read_text())
    config["task"]["train_size"], config["run"]["dir"] = 1024, str(mid)
    (mid / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match="setting replay_mid matches none of the baselines' pools on task.train_size"):
        report([*sorted(dirs), mid], tmp_path / "bad", baseline=both)
    with pytest.raises(ConfigError, match="a baseline named twice"):
        report(sorted(dirs), tmp_path / "bad", baseline="on_policy_small,on_policy_small")
    assert not (tmp_path / "bad").exists()


def test_the_rule_and_the_contrast_are_declared_in_the_sweep_file_and_checked_before_any_run(tmp_path):
    path = tmp_path / "sweep.yaml"
    body = {"base": str(DEMO), "out": "runs", "seeds": [0], "claims": CLAIMS, "regime": REGIME,
            "settings": {"on_policy_small": ["replay.mode=on_policy", "task.train_size=512"],
                         "replay_small": ["task.train_size=512"],
                         "on_policy_full": ["replay.mode=on_policy", "task.train_size=2048"],
                         "replay_full": ["task.train_size=2048"]}}
    path.write_text(yaml.safe_dump(body))
    sweep = load_sweep(path)
    for run in sweep.runs:
        run.dir.mkdir(parents=True)
        (run.dir / "summary.json").write_text(json.dumps({"steps": run.config.train.steps}))
    run_sweep(sweep, log=lambda _: None)
    assert yaml.safe_load((tmp_path / "runs" / "regime.yaml").read_text()) == Regime(**REGIME).__dict__ | {
        "statistic": "median"}
    for change, error in (({"regime": None}, "sweep.claims.regime_contrast.regime: needs the sweep's `regime`"),
                          ({"regime": {**REGIME, "setting": "nope"}}, "sweep.regime.setting: nope is not one"),
                          ({"regime": {**REGIME, "plateu": 0.01}}, "did you mean plateau"),
                          ({"claims": {"c": {**CLAIMS["regime_contrast"], "contrast": {
                              "settings": ["nope"], "baseline": "on_policy_full"}}}},
                           "sweep.claims.c.contrast: nope is not one of the settings"),
                          ({"claims": {"c": {**CLAIMS["regime_contrast"], "measure": "tokens_to_90"}}},
                           "an accuracy-like measure")):
        path.write_text(yaml.safe_dump({**body, **change}))
        with pytest.raises(ConfigError, match=error):
            load_sweep(path)
    with pytest.raises(ConfigError, match="sweep.regime.evaluations: expected a positive integer"):
        parse_regime({"setting": "a", "evaluations": 0})
