"""The two-stage protocol in `jaxreplay report`: stage 1 picks each arm's learning rate on the
validation split by the declared rule (report_select), stage 2 draws the frontier against the
stage-1 grid (report_frontier), and the claim measures at equal modelled compute.

Synthetic run dirs as the recorder writes them (config.yaml, metrics.jsonl, summary.json), evaluated
at steps 0, 10, 20, 30. Per learner step every run trains 4 rollouts and generates 4 (on_policy) or
2 (spi2), so at µ = 1 its modelled compute is 8 or 6 per step: evaluations at compute 0, 80, 160, 240
(on_policy) and 0, 60, 120, 180 (spi2). Every number below is computed here from those.
"""

import json
import re
import shutil
import subprocess
import sys
from glob import glob
from pathlib import Path

import numpy as np
import pytest
import yaml

from jaxreplay.config import ConfigError
from jaxreplay.research.report import report
from jaxreplay.research.report_claims import parse_claims
from jaxreplay.research.report_data import RunData, Setting, group_settings, load_runs
from jaxreplay.research.report_frontier import ArmFrontier, budget
from jaxreplay.research.report_select import Rule, arm_grid, choose, lr_tag, parse_rule, validation_scores
from jaxreplay.research.report_stats import bootstrap_ci, iqm
from report_tables import markdown_tables

EVAL_STEPS = (0, 10, 20, 30)
GENERATED = {"on_policy": 4.0, "spi2": 2.0}  # rollouts generated per learner step; 4 trained
MODE = {"on_policy": ("on_policy", 1.0), "spi2": ("replay", 2.0)}
LRS = (1e-4, 3e-4, 1e-3)


def make_run(root, folder, arm, seed, lr, test, validation=None, entropy0=1.0):
    """A run dir as the recorder leaves it; `validation` None: a run without the validation split."""
    mode, spi = MODE[arm]
    d = root / folder / f"seed{seed}"
    d.mkdir(parents=True)
    config = {"replay": {"mode": mode, "samples_per_insert": spi, "max_size": 32},
              "train": {"batch_size": 4, "prompts_per_step": 2, "group_size": 2, "learning_rate": lr},
              "task": {"validation_size": 0 if validation is None else 64},
              "run": {"seed": seed, "dir": str(d)}}
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    records = []
    for step in range(0, 31):
        generated = GENERATED[arm] * step
        rec = {"step": step}
        if step:
            rec.update({"rollouts/generated": generated, "rollouts/trained": 4.0 * step,
                        "tokens/generated": 10 * generated, "entropy": entropy0 - 0.01 * step, "cost/mu": 1.0,
                        "replay/ratio": spi, "staleness/mean": 1.0})
        if step in EVAL_STEPS:
            rec["eval/accuracy"] = test[EVAL_STEPS.index(step)]
            if validation is not None:
                rec["eval/validation_accuracy"] = validation[EVAL_STEPS.index(step)]
        records.append(rec)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (d / "summary.json").write_text(json.dumps({"steps": 30}))
    return d


STAGE1_TABLES = ("Learning rates (validation split)", "Stage 1: learning rates (validation split)")


def tables(md):
    return markdown_tables(md, STAGE1_TABLES)


def _numbers(text):
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?", text)]


# -- stage 1: every arm at every rate; validation picks, test never does ---------------------------
# (arm, lr) -> per seed (test curve, validation curve). Where the two splits disagree, validation decides:
# on_policy's test peak is best at 1e-3 but its validation peak at 3e-4; spi2's validation favours 1e-3.
STAGE1 = {
    ("on_policy", 1e-4): [([0.2, 0.3, 0.4, 0.45], [0.2, 0.3, 0.4, 0.42]),
                          ([0.2, 0.3, 0.35, 0.4], [0.2, 0.3, 0.38, 0.4])],
    ("on_policy", 3e-4): [([0.2, 0.4, 0.5, 0.5], [0.2, 0.5, 0.6, 0.55]),
                          ([0.2, 0.4, 0.55, 0.5], [0.2, 0.5, 0.62, 0.6])],
    ("on_policy", 1e-3): [([0.2, 0.6, 0.7, 0.3], [0.2, 0.45, 0.5, 0.3]),
                          ([0.2, 0.6, 0.65, 0.3], [0.2, 0.4, 0.52, 0.3])],
    ("spi2", 1e-4): [([0.2, 0.25, 0.3, 0.35], [0.2, 0.25, 0.3, 0.35]), ([0.2, 0.25, 0.3, 0.3], [0.2, 0.25, 0.3, 0.3])],
    ("spi2", 3e-4): [([0.2, 0.3, 0.4, 0.5], [0.2, 0.3, 0.4, 0.5]), ([0.2, 0.3, 0.45, 0.5], [0.2, 0.3, 0.45, 0.5])],
    ("spi2", 1e-3): [([0.2, 0.5, 0.6, 0.6], [0.2, 0.5, 0.6, 0.65]), ([0.2, 0.45, 0.6, 0.55], [0.2, 0.5, 0.6, 0.6])],
}
SELECT = {"measure": "validation_peak", "statistic": "median", "ties": "lower_lr"}


def stage1_dirs(root):
    dirs = [make_run(root, f"{arm}.lr{lr_tag(lr)}", arm, seed, lr, test, val)
            for (arm, lr), seeds in STAGE1.items() for seed, (test, val) in enumerate(seeds)]
    (root / "select.yaml").write_text(yaml.safe_dump(SELECT))  # as `jaxreplay sweep` writes it
    return dirs


@pytest.fixture(scope="module")
def stage1(tmp_path_factory):
    root = tmp_path_factory.mktemp("stage1")
    dirs = stage1_dirs(root / "runs")
    out = root / "report"
    report(dirs, out)
    return dirs, out


def test_lr_tags_are_short_and_exact():
    assert [lr_tag(x) for x in (1e-4, 3e-4, 0.001, 2.5e-4, 1e-05, 0.1)] == \
        ["1e-4", "3e-4", "1e-3", "2.5e-4", "1e-5", "1e-1"]


def test_stage1_picks_each_arms_rate_by_validation_where_the_test_split_disagrees(stage1):
    _, out = stage1
    # on_policy validation peaks (median of two seeds): 0.41, 0.61, 0.51 -> 3e-4 (test peaks: 0.425, 0.525, 0.675).
    # spi2: 0.325, 0.475, 0.625 -> 1e-3.
    assert yaml.safe_load((out / "selected.yaml").read_text()) == {"on_policy": 3e-4, "spi2": 1e-3}
    rows = tables((out / "report.md").read_text())["Learning rates (validation split)"]
    assert set(rows) == {(arm, lr_tag(lr)) for arm, lr in STAGE1}
    on = {lr: rows[("on_policy", lr)] for lr in ("1e-4", "3e-4", "1e-3")}
    assert [_numbers(on[lr]["validation_peak (validation)"]) for lr in on] == \
        [pytest.approx([0.41, 0.405, 0.415]), pytest.approx([0.61, 0.605, 0.615]), pytest.approx([0.51, 0.505, 0.515])]
    assert _numbers(on["1e-3"]["test peak (not used)"])[0] == pytest.approx(0.675)
    assert _numbers(on["1e-3"]["test final (not used)"]) == pytest.approx([0.3] * 3)
    assert [on[lr]["chosen"] for lr in on] == ["", "**chosen**", ""]
    assert rows[("spi2", "1e-3")]["chosen"] == "**chosen**"
    assert "eval/validation_accuracy` only" in (out / "report.md").read_text()


def _grid(dirs):
    return arm_grid(group_settings(load_runs(dirs)))


def test_the_rule_never_reads_the_test_split(stage1):
    """Structural: runs whose test series is gone, or scrambled, give the rule the same inputs and choice."""
    dirs, _ = stage1
    grid = _grid(dirs)
    rule = parse_rule(SELECT)
    scores = validation_scores(grid, rule)
    for rates in grid.values():
        for s in rates.values():
            for run in s.runs:
                run.records = [{k: v for k, v in r.items() if k != "eval/accuracy"} for r in run.records]
                run.__post_init__()
    assert validation_scores(grid, rule) == scores
    assert choose(scores, rule) == {"on_policy": 3e-4, "spi2": 1e-3}


def test_equal_statistics_go_to_the_lower_learning_rate():
    rule = Rule("validation_peak", "median")
    assert choose({"a": {1e-3: [0.5, 0.7], 3e-4: [0.6, 0.6], 1e-4: [0.4, 0.4]}}, rule) == {"a": 3e-4}
    assert choose({"a": {1e-3: [0.6], 1e-4: [0.6 + 1e-15]}}, rule) == {"a": 1e-4}


def test_the_statistic_and_the_measure_are_the_declared_ones():
    scores = {"a": {1e-4: [0.9, 0.1, 0.1], 1e-3: [0.3, 0.3, 0.3]}}
    assert choose(scores, Rule("validation_peak", "median")) == {"a": 1e-3}  # medians 0.1 and 0.3
    assert choose(scores, Rule("validation_peak", "mean")) == {"a": 1e-4}  # means 0.367 and 0.3
    skewed = {"a": {1e-4: [0.0, 0.45, 0.5, 0.6, 0.7, 0.7], 1e-3: [0.5] * 6}}
    assert choose(skewed, Rule("validation_peak", "iqm")) == {"a": 1e-4}  # IQM 0.5625 (the middle four) > 0.5
    assert choose(skewed, Rule("validation_peak", "mean")) == {"a": 1e-3}  # mean 0.49 < 0.5
    run = RunData(dir=Path("x"), config={}, records=[
        {"step": s, "eval/accuracy": 0.0, "eval/validation_accuracy": v} for s, v in zip((0, 10, 20), (0.2, 0.8, 0.5))])
    grid = {"a": {1e-4: Setting(name="a.lr1e-4", runs=[run])}}
    assert [validation_scores(grid, Rule(m, "median"))["a"][1e-4] for m in
            ("validation_peak", "validation_final", "validation_mean")] == [[0.8], [0.5], [pytest.approx(0.5)]]


def test_a_run_without_the_validation_series_is_an_error_naming_it(tmp_path):
    dirs = stage1_dirs(tmp_path / "runs")
    bad = make_run(tmp_path / "runs", "spi2.lr1e-2", "spi2", 0, 1e-2, [0.2, 0.3, 0.4, 0.5], [0.2, 0.3, 0.4, 0.5])
    rows = [json.loads(line) for line in (bad / "metrics.jsonl").open()]  # e.g. written before the split existed
    (bad / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items()
                                                           if k != "eval/validation_accuracy"}) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=re.escape(f"{bad}: no eval/validation_accuracy")):
        report([*dirs, bad], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    cli = subprocess.run([sys.executable, "-m", "jaxreplay.cli", "report", *map(str, [*dirs, bad]), "--out",
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and len(cli.stderr.strip().splitlines()) == 1, cli.stderr
    assert "spi2.lr1e-2/seed0: no eval/validation_accuracy" in cli.stderr


def test_an_arms_rate_comes_from_its_config_and_must_agree_with_its_folder(tmp_path):
    dirs = stage1_dirs(tmp_path / "runs")
    config = yaml.safe_load((dirs[0] / "config.yaml").read_text())
    config["train"]["learning_rate"] = 2e-4
    (dirs[0] / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match="folder on_policy.lr1e-4 says learning rate 1e-4, its config.yaml says 2e-4"):
        _grid(dirs)
    config["train"]["learning_rate"], config["train"]["batch_size"] = 1e-4, 8
    (dirs[0] / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match="runs of arm on_policy differ in more than train.learning_rate"):
        _grid(dirs[:1] + dirs[2:])  # seed 0 alone in its folder, with another batch size


@pytest.mark.parametrize("raw,key", [
    ({"measure": "test_peak", "statistic": "median"}, "sweep.select.measure"),
    ({"measure": "validation_peak", "statistic": "max"}, "sweep.select.statistic"),
    ({"measure": "validation_peak", "statistic": "median", "ties": "higher_lr"}, "sweep.select.ties"),
    ({"measure": "validation_peak", "statistc": "median"}, "sweep.select: unknown key statistc"),
    ("validation_peak", "sweep.select"),
])
def test_a_bad_rule_is_one_clear_error(raw, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        parse_rule(raw)


# -- stage 2: the frontier against the stage-1 grid ----------------------------------------------
STAGE2 = {  # setting -> lr (stage 1's choice), per seed its test curve
    "on_policy": (3e-4, [[0.2, 0.4, 0.5, 0.6], [0.2, 0.5, 0.6, 0.6], [0.2, 0.3, 0.5, 0.7]]),
    "spi2": (1e-3, [[0.2, 0.5, 0.6, 0.7], [0.2, 0.4, 0.6, 0.6], [0.2, 0.6, 0.6, 0.5]]),
}
COMPUTE = {"on_policy": np.array([0.0, 80, 160, 240]), "spi2": np.array([0.0, 60, 120, 180])}  # at µ = 1


def stage2_dirs(root):
    return [make_run(root, s, s, seed, lr, test, [0.1] * 4) for s, (lr, seeds) in STAGE2.items()
            for seed, test in enumerate(seeds)]


@pytest.fixture(scope="module")
def stage2(tmp_path_factory, stage1):
    root = tmp_path_factory.mktemp("stage2")
    dirs = stage2_dirs(root / "runs")
    out = root / "report"
    report(dirs, out, mus=(1.0,), stage1=stage1[0])
    return dirs, out


def test_the_frontier_table_reads_each_arm_at_shares_of_the_common_budget(stage2):
    _, out = stage2
    md = (out / "report.md").read_text()
    rows = tables(md)["Optimality frontier at µ = 1"]
    budget = 180.0  # the least last-evaluation compute: spi2's
    for arm, (lr, seeds) in STAGE2.items():
        row = rows[arm]
        assert row["learning rate (chosen)"] == lr_tag(lr) and row["seeds"] == "3"
        for f in (0.25, 0.5, 1.0):
            x = f * budget
            at = [np.interp(x, COMPUTE[arm], acc) for acc in seeds]
            assert _numbers(row[f"at {f:.0%} of 180: chosen lr"]) == \
                pytest.approx([np.median(at), np.percentile(at, 25), np.percentile(at, 75)], rel=5e-3)
            # Best over the grid: each stage-1 rate's median curve (of two seeds: their mean) at x; the highest.
            medians = {l: np.interp(x, COMPUTE[arm], np.median([t for t, _ in STAGE1[(arm, l)]], axis=0)) for l in LRS}
            best = max(LRS, key=lambda l: (medians[l], -l))
            cell = row[f"at {f:.0%}: best over the grid (its lr)"]
            assert _numbers(cell)[0] == pytest.approx(medians[best], rel=5e-3) and cell.endswith(f"({lr_tag(best)})")
    # on_policy at 180, a quarter of the way from 160 to 240: 1e-3's median goes 0.675 -> 0.3 (0.581), 3e-4's
    # 0.525 -> 0.5 (0.519); at 90, an eighth of the way from 80 to 160: 1e-3's 0.6 -> 0.675 (0.609).
    assert rows["on_policy"]["at 100%: best over the grid (its lr)"] == "0.581 (1e-3)"
    assert rows["on_policy"]["at 50%: best over the grid (its lr)"] == "0.609 (1e-3)"
    assert "![Frontier at µ = 1: chosen lr" in md and (out / "frontier_mu1.png").stat().st_size > 10_000


def test_the_best_over_the_grid_and_the_common_budget_stop_where_the_shortest_rates_curve_ends():
    """Rates end at slightly different compute; past the shortest, the envelope would be whichever rate runs
    longest (in the multiplication study a collapsed rate: every arm's dashed line fell to 0.05 at its end)."""
    arm = ArmFrontier(name="on_policy", learning_rate=1e-4, runs=[(np.array([0.0, 250.0]), np.array([0.2, 0.6]))],
                      medians={1e-4: (np.array([0.0, 100.0, 200.0]), np.array([0.2, 0.5, 0.6])),
                               4e-4: (np.array([0.0, 100.0, 230.0]), np.array([0.2, 0.3, 0.05]))})
    assert arm.best(150.0) == (pytest.approx(0.55), 1e-4)
    assert arm.best(200.0) == (pytest.approx(0.6), 1e-4)
    assert arm.best(210.0) is None  # only 4e-4 reaches it
    x, y = arm.envelope()
    assert x.tolist() == [0.0, 100.0, 200.0] and y.tolist() == pytest.approx([0.2, 0.5, 0.6])
    assert budget([arm]) == 200.0  # so the table's 100% column has a best-over-the-grid value for every arm


def test_the_stage2_report_holds_the_stage1_table_and_refuses_a_rate_stage1_did_not_choose(stage1, stage2, tmp_path):
    _, out = stage2
    rows = tables((out / "report.md").read_text())["Stage 1: learning rates (validation split)"]
    assert rows[("on_policy", "3e-4")]["chosen"] == "**chosen**" and len(rows) == 6
    dirs = stage2_dirs(tmp_path / "runs")
    for d in dirs[3:]:  # spi2 at 3e-4, stage 1 chose 1e-3
        config = yaml.safe_load((d / "config.yaml").read_text())
        config["train"]["learning_rate"] = 3e-4
        (d / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"learning rate 3e-4 is not stage 1's choice for arm spi2 \(1e-3\)"):
        report(dirs, tmp_path / "out", mus=(1.0,), stage1=stage1[0])
    with pytest.raises(ConfigError, match="--stage1: the frontier is drawn against modelled compute at the first --mu"):
        report(stage2_dirs(tmp_path / "again"), tmp_path / "out", stage1=stage1[0])
    assert not (tmp_path / "out").exists()


def _rebuild(folder, tmp_path):
    """What a reviewer does: copy the report's folder, run the command on its Data line (globs expanded
    as a shell would), compare."""
    md = (folder / "report.md").read_text()
    command = re.search(r"`(jaxreplay report runs/\*/\* --out \.[^`]*)`", md).group(1)
    work = tmp_path / "rebuild"
    for sub in ("runs", "stage1"):
        if (folder / sub).is_dir():
            shutil.copytree(folder / sub, work / sub)
    args = [a for arg in command.split()[2:] for a in (sorted(glob(arg, root_dir=work)) if "*" in arg else [arg])]
    out = subprocess.run([sys.executable, "-m", "jaxreplay.cli", "report", *args], cwd=work, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return work, md


def test_a_stage2_report_with_stage1_rebuilds_byte_for_byte_from_its_copies(stage2, tmp_path):
    _, out = stage2
    work, md = _rebuild(out, tmp_path)
    assert "`jaxreplay report runs/*/* --out . --mu 1 --stage1 stage1/*/*`" in md
    assert "rebuilt from `runs/` and `stage1/` alone" in md and str(out.parent) not in md
    assert sorted(p.relative_to(out / "stage1").as_posix() for p in (out / "stage1").glob("*/*")) == \
        sorted(f"{arm}.lr{lr_tag(lr)}/seed{s}" for (arm, lr), seeds in STAGE1.items() for s in range(len(seeds)))
    assert (work / "report.md").read_text() == md
    for png in out.glob("*.png"):
        assert (work / png.name).read_bytes() == png.read_bytes(), png.name


def test_a_stage1_report_rebuilds_byte_for_byte_with_its_selection(stage1, tmp_path):
    _, out = stage1
    work, md = _rebuild(out, tmp_path)
    assert (work / "report.md").read_text() == md
    assert (work / "selected.yaml").read_bytes() == (out / "selected.yaml").read_bytes()
    assert (out / "runs" / "select.yaml").exists()


# -- claim measures at equal modelled compute, and the largest fall ---------------------------------
# Per seed: on_policy and spi2 test curves (evaluations at compute 0, 80, 160, 240 and 0, 60, 120, 180 at µ 1).
CLAIM_RUNS = {
    "on_policy": [[0.2, 0.5, 0.6, 0.7], [0.2, 0.6, 0.4, 0.65], [0.2, 0.5, 0.55, 0.5]],
    "spi2": [[0.2, 0.55, 0.65, 0.62], [0.2, 0.5, 0.5, 0.5], [0.2, 0.6, 0.5, 0.55]],
}
CLAIMS = {
    "same_final": {"settings": ["spi2"], "measure": "final_at_compute", "mu": 1.0, "above": -0.2},
    "more_entropy": {"settings": ["spi2"], "measure": "entropy_at_compute", "mu": 1.0, "above": 0.0},
    "falls_less": {"settings": ["spi2"], "measure": "largest_fall", "below": 0.0},
    "ceiling": {"settings": ["spi2"], "measure": "final_at_compute", "mu": 1.0, "above": -0.2, "ceiling": 0.5},
}


def claims_report(tmp_path, entropy0=1.0):
    dirs = [make_run(tmp_path / "runs", s, s, seed, 3e-4, acc, entropy0=entropy0 if s == "spi2" else 1.0)
            for s, seeds in CLAIM_RUNS.items() for seed, acc in enumerate(seeds)]
    (tmp_path / "runs" / "claims.yaml").write_text(yaml.safe_dump(CLAIMS))
    report(dirs, tmp_path / "out")
    return tables((tmp_path / "out" / "report.md").read_text())["Claims and verdicts"]


def _numbers_of(diffs):
    """The claim's numbers; on three seeds the bootstrap's IQMs are a few atoms, so no stream moves an end (±0)."""
    lo, hi = bootstrap_ci([diffs])
    return f"IQM {iqm(diffs):.3g} [{lo:.3g} ±0, {hi:.3g} ±0] over {len(diffs)} paired seeds"


def test_final_accuracy_at_equal_compute_reads_each_run_at_or_before_the_smaller_total(tmp_path):
    rows = claims_report(tmp_path)
    # Totals at µ 1: on_policy 240, spi2 180. At 180 on_policy's latest evaluation is the one at 160
    # (step 20), spi2's its last (step 30).
    diffs = [CLAIM_RUNS["spi2"][s][3] - CLAIM_RUNS["on_policy"][s][2] for s in range(3)]  # 0.02, 0.1, 0
    assert diffs == pytest.approx([0.02, 0.1, 0.0])
    row = rows["same_final"]
    assert row["rule (declared in the sweep file)"] == "paired IQM of final_at_compute − on_policy's (µ = 1) > -0.2"
    assert row["paired numbers"].startswith(_numbers_of(diffs)) and row["verdict"] == "holds"
    # The ceiling reads on_policy's own accuracy at those budgets: 0.6, 0.4, 0.55, median 0.55 >= 0.5.
    assert rows["ceiling"]["verdict"] == "not testable here: on_policy's median final_at_compute is 0.55, " \
                                         "at or above the ceiling 0.5"


def test_entropy_at_equal_compute_is_the_mean_of_the_last_ten_logged_steps_before_it(tmp_path):
    rows = claims_report(tmp_path, entropy0=0.9)
    # Entropy is e0 - 0.01 step. At 180, on_policy (8 a step) has logged steps 1..22: the last ten 13..22
    # average to 1 - 0.175; spi2 (6 a step) steps 21..30: 0.9 - 0.255. Every seed: -0.18.
    row = rows["more_entropy"]
    assert row["paired numbers"].startswith(_numbers_of([-0.18] * 3)) and row["verdict"] == "fails"


def test_the_largest_fall_after_the_peak_is_a_paired_difference(tmp_path):
    rows = claims_report(tmp_path)
    # on_policy falls 0, 0.2 (0.6 -> 0.4), 0.05; spi2 0.03, 0, 0.1 (0.6 -> 0.5).
    diffs = [0.03, -0.2, 0.05]
    row = rows["falls_less"]
    assert row["paired numbers"].startswith(_numbers_of(diffs)) and row["verdict"] == "inconclusive"


def test_final_accuracy_at_equal_wall_clock_reads_each_run_at_or_before_the_smaller_total_seconds(tmp_path):
    """on_policy takes 3 s a step (90 s in all), spi2 5 s: at 90 s spi2's latest evaluation is step 10's
    (50 s; step 20's comes at 100 s), on_policy's its last. The same cut at compute would read other ones."""
    dirs = [make_run(tmp_path / "runs", s, s, seed, 3e-4, acc) for s, seeds in CLAIM_RUNS.items()
            for seed, acc in enumerate(seeds)]
    for d in dirs:
        per_step = 3.0 if d.parent.name == "on_policy" else 5.0
        records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        for r in records[1:]:
            r.update({"time/generate_timed_s": per_step * r["step"], "time/train_timed_s": 0.0, "time/replay_s": 0.0})
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "runs" / "claims.yaml").write_text(yaml.safe_dump({
        "same_final_in_time": {"settings": ["spi2"], "measure": "final_at_wallclock", "above": -0.1},
        "sooner": {"settings": ["spi2"], "measure": "wallclock_to_50", "below": 1.0},
        "more_entropy_in_time": {"settings": ["spi2"], "measure": "entropy_at_wallclock", "above": 0.0}}))
    report(dirs, tmp_path / "out")
    rows = tables((tmp_path / "out" / "report.md").read_text())["Claims and verdicts"]
    diffs = [CLAIM_RUNS["spi2"][s][1] - CLAIM_RUNS["on_policy"][s][3] for s in range(3)]  # -0.15, -0.15, 0.1
    assert diffs == pytest.approx([-0.15, -0.15, 0.1])
    row = rows["same_final_in_time"]
    assert row["rule (declared in the sweep file)"] == "paired IQM of final_at_wallclock − on_policy's > -0.1"
    assert row["paired numbers"].startswith(_numbers_of(diffs))
    # Half of each seed's on-policy gain (0.45, 0.425, 0.375): both reach it at their first evaluation after
    # the start (step 10), spi2 at 50 s against on_policy's 30 s, a ratio of 5/3 on every seed.
    assert rows["sooner"]["paired numbers"].startswith(_numbers_of([5 / 3] * 3))
    # Entropy 1 - 0.01 step over the last ten logged steps by 90 s: on_policy's 21..30, spi2's 9..18.
    assert rows["more_entropy_in_time"]["paired numbers"].startswith(_numbers_of([0.12] * 3))


@pytest.mark.parametrize("rule,message", [
    ({"settings": ["a"], "measure": "final_at_compute", "above": 0}, "x.mu: final_at_compute needs the positive µ"),
    ({"settings": ["a"], "measure": "entropy_at_compute", "above": 0}, "x.mu: entropy_at_compute needs"),
    ({"settings": ["a"], "measure": "largest_fall", "below": 0, "ceiling": 0.9}, "x.ceiling: largest_fall has no"),
    ({"settings": ["a"], "measure": "entropy_at_compute", "mu": 5.28, "above": 0, "ceiling": 0.9},
     "x.ceiling: entropy_at_compute has no"),
    ({"settings": ["a"], "measure": "fall", "below": 0}, "x.measure: 'fall' is not"),
    ({"settings": ["a"], "measure": "final_at_time", "above": 0}, "x.measure: 'final_at_time' is not"),
])
def test_new_claim_measures_are_parsed_with_their_mu_and_without_a_meaningless_ceiling(rule, message):
    with pytest.raises(ConfigError, match=re.escape(f"sweep.claims.{message}")):
        parse_claims({"x": rule})
    ok = parse_claims({"y": {"settings": ["a"], "measure": "final_at_compute", "mu": 5.28, "above": -0.02,
                             "ceiling": 0.9}})
    assert ok[0].mu == 5.28 and ok[0].ceiling == 0.9
