"""`jaxreplay report` on synthetic run dirs whose every reported number is computed by hand here.

Three settings, R = 4 rollouts per actor step, B = 4, evaluations at steps 0, 10, 20, 30:
- on_policy (3 seeds): 4 rollouts generated and 4 trained per step, 10 tokens per rollout;
- spi2 (3 seeds): 2 generated and 4 trained per step; max_size 32 (N/R = 8, 16 learner steps);
- spi8 (2 seeds): 0.5 generated and 4 trained per step; max_size 16 (N/R = 4, 32 learner steps).
Every run starts at 0.2. Targets are shares of the same seed's on_policy gain: seed 0 gains 0.4
(peak 0.6), seed 1 0.4 (peak 0.6), seed 2 0.5 (peak 0.7), so the 90% targets are 0.56, 0.56, 0.65,
which the on_policy seeds first reach at steps 20, 30, 20.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import yaml

from jaxreplay.config import ConfigError
from jaxreplay.research import report_plots
from jaxreplay.research.report import report
from jaxreplay.research.report_data import RunData, group_settings, load_runs, pick_baseline
from jaxreplay.research.report_stats import band, bootstrap_ci, iqm, parse_mus
from report_tables import markdown_tables

EVAL_STEPS = (0, 10, 20, 30)
SETTINGS = {  # name: (mode, samples_per_insert, max_size, rollouts generated per learner step)
    "on_policy": ("on_policy", 1.0, 64, 4.0),
    "spi2": ("replay", 2.0, 32, 2.0),
    "spi8": ("replay", 8.0, 16, 0.5),
}
RUNS = [  # setting, seed, accuracy at EVAL_STEPS, last cost/mu, entropy at step 0
    ("on_policy", 0, [0.2, 0.4, 0.6, 0.5], 0.4, 1.0),
    ("on_policy", 1, [0.2, 0.5, 0.5, 0.6], 0.5, 1.1),
    ("on_policy", 2, [0.2, 0.3, 0.7, 0.7], 0.6, 1.2),
    ("spi2", 0, [0.2, 0.6, 0.7, 0.7], 0.5, 1.0),  # reaches 0.6 at step 10
    ("spi2", 1, [0.2, 0.5, 0.65, 0.6], 0.5, 1.0),  # at step 20
    ("spi2", 2, [0.2, 0.4, 0.5, 0.55], 0.5, 1.0),  # never
    ("spi8", 0, [0.2, 0.3, 0.4, 0.5], 0.3, 1.0),  # never
    ("spi8", 1, [0.2, 0.3, 0.4, 0.45], 0.7, 1.0),  # never
]
MEASURED_MU = 0.5  # median of the eight runs' last cost/mu
ROOT = Path(__file__).resolve().parents[1]


def _run_dir(root, setting, seed, acc, mu, entropy0):
    mode, spi, max_size, gen_per_step = SETTINGS[setting]
    d = root / setting / f"seed{seed}"
    d.mkdir(parents=True)
    config = {"replay": {"mode": mode, "samples_per_insert": spi, "max_size": max_size},
              "train": {"batch_size": 4, "prompts_per_step": 2, "group_size": 2},
              "run": {"seed": seed, "dir": str(d)}}
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    records = [{"step": 0, "eval/accuracy": acc[0]}]
    for step in range(1, 31):
        generated = gen_per_step * step
        rec = {"step": step, "rollouts/generated": generated, "rollouts/trained": 4 * step,
               "tokens/generated": 10 * generated, "compute/flops": 100.0 * step,
               **({} if mu is None else {"cost/mu": mu if step == 30 else 9.0}), "entropy": entropy0 - 0.01 * step, "approx_kl": 0.001 * step,
               "pg_clipfrac": 0.002 * step, "replay/ratio": spi * step / (step + 1), "staleness/mean": 1.0 + seed,
               "staleness/hist": [3, 1, 0, 0, 0, 0, 0, 0, 0, 0], "time/generate_timed_s": 0.5 * (step - 1),
               "time/train_timed_s": 0.25 * (step - 1), "time/replay_s": 0.0,
               "time/generate_s": 20 + 0.5 * step, "time/train_s": 30 + 0.25 * step}
        if step in EVAL_STEPS:
            rec["eval/accuracy"] = acc[EVAL_STEPS.index(step)]
        records.append(rec)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (d / "summary.json").write_text(json.dumps({"steps": 30, "cost/mu": mu}))
    return d


@pytest.fixture(scope="module")
def sweep_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    dirs = [_run_dir(root, *run) for run in RUNS]
    # pass@k of the final policies, as `jaxreplay eval ... --k 1,4,16 --out RUN_DIR/eval.json` writes it.
    for d, (p1, p4, p16) in ((dirs[0], (0.3, 0.5, 0.7)), (dirs[1], (0.3, 0.55, 0.75)), (dirs[3], (0.35, 0.6, 0.8))):
        (d / "eval.json").write_text(json.dumps({"pass@1_t0.1": p1 + 0.02, "pass@k_t1.0": {"1": p1, "4": p4, "16": p16}}))
    return dirs


def _numbers(text):
    """'0.375 [0.312, 0.438] (2/3)' -> [0.375, 0.312, 0.438, 2, 3] (three significant digits: rel=5e-3)."""
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?", text)]


def _iqr(values):
    return [np.median(values), np.percentile(values, 25), np.percentile(values, 75)]


def _column(row, prefix):
    (key,) = [k for k in row if k.startswith(prefix)]
    return row[key]


@pytest.fixture(scope="module")
def out(sweep_dirs, tmp_path_factory):
    """One report for the tests that read it (writing the PNGs takes seconds)."""
    out = tmp_path_factory.mktemp("report")
    report(sweep_dirs, out, mus=(5.28, 6.84))
    return out


@pytest.fixture(scope="module")
def md(out):
    return (out / "report.md").read_text()


def test_seeds_group_into_settings_and_the_on_policy_one_is_the_baseline(sweep_dirs):
    settings = group_settings(load_runs(sweep_dirs))
    assert [(s.name, len(s.runs)) for s in settings] == [("on_policy", 3), ("spi2", 3), ("spi8", 2)]
    assert pick_baseline(settings, None).name == "on_policy"
    assert [s.horizon() for s in settings] == [None, (8.0, 16.0), (4.0, 32.0)]
    with pytest.raises(ConfigError, match="not one of the settings"):
        pick_baseline(settings, "spi16")


def test_seeds_kept_differently_are_one_setting_and_a_changed_setting_is_another(tmp_path):
    """Where a run kept its warm start or checkpoints, or how long it waited, is not its setting."""
    dirs = [_run_dir(tmp_path, *run) for run in RUNS[:3]]
    for d, kept in zip(dirs, ({"warmstart": {"cache_dir": "/a"}, "checkpoint": {"every": 10}},
                              {"warmstart": {"cache_dir": "/b"}, "replay": {"timeout_s": 5, "port": 4000}}, {})):
        config = yaml.safe_load((d / "config.yaml").read_text())
        for section, values in kept.items():
            config.setdefault(section, {}).update(values)
        (d / "config.yaml").write_text(yaml.safe_dump(config))
    assert [(s.name, len(s.runs)) for s in group_settings(load_runs(dirs))] == [("on_policy", 3)]
    config = yaml.safe_load((dirs[2] / "config.yaml").read_text())
    config["train"]["batch_size"] = 8
    (dirs[2] / "config.yaml").write_text(yaml.safe_dump(config))
    assert [(s.name, len(s.runs)) for s in group_settings(load_runs(dirs))] == [("on_policy", 2), ("on_policy#2", 1)]


def test_accuracy_is_the_median_and_iqr_over_seeds_and_entropy_the_mean_of_the_last_ten_steps(md):
    rows = markdown_tables(md)["Per setting"]
    on, spi8 = rows["on_policy (baseline)"], rows["spi8"]
    assert _numbers(on["start eval accuracy"]) == pytest.approx([0.2] * 3)
    assert _numbers(on["peak eval accuracy"]) == pytest.approx([0.6, 0.6, 0.65])
    assert _numbers(on["final eval accuracy"]) == pytest.approx([0.6, 0.55, 0.65])
    assert _numbers(spi8["peak eval accuracy"]) == pytest.approx([0.475, 0.4625, 0.4875], abs=6e-4)
    # Steps 21..30 average to entropy0 - 0.255: seeds 0.745, 0.845, 0.945 (the last value alone would be 0.1 less).
    assert _numbers(_column(on, "entropy at end")) == pytest.approx([0.845, 0.795, 0.895])
    # median [IQR] (target) of the last replay/ratio, spi * 30 / 31 in every seed
    assert _numbers(_column(rows["spi2"], "replay ratio")) == pytest.approx([60 / 31] * 3 + [2], rel=5e-3)
    assert "`median [q25, q75]` over seeds" in md


TARGET_90 = "Cost to 90% of the seed's on_policy gain, × the same seed's on_policy run"


def test_tokens_to_a_target_are_paired_censored_ratios_to_the_same_seeds_baseline(md):
    rows = markdown_tables(md)[TARGET_90]
    # spi2 reaches its seed's 0.56, 0.56, 0.65 at steps 10, 20, never: 200 and 400 tokens (20 a step)
    # against on_policy's 800 and 1200 (40 a step, steps 20 and 30); seed 2 is censored: +inf.
    ratios = [200 / 800, 400 / 1200, np.inf]
    assert rows["spi2"]["seeds that reach it"] == "2/3"
    med, q1 = np.median(ratios[:2] + [ratios[1]]), 0.25 + 0.5 * (400 / 1200 - 0.25)
    assert rows["spi2"]["generated tokens"] == f"{1 / 3:.3g} [{q1:.3g}, > budget]; IQM > budget [0.25, > budget]"
    assert med == pytest.approx(1 / 3)
    assert rows["spi2"]["generated rollouts"] == rows["spi2"]["generated tokens"]  # 10 tokens a rollout
    # The baseline against itself: 1 on every seed.
    assert rows["on_policy (baseline)"]["generated tokens"] == "1 [1, 1]; IQM 1 [1, 1]"
    assert rows["spi8"]["seeds that reach it"] == "0/2" and rows["spi8"]["generated tokens"].startswith("> budget")


def test_lower_targets_are_lower_shares_of_the_same_seeds_gain(md):
    rows = markdown_tables(md)["Cost to 50% of the seed's on_policy gain, × the same seed's on_policy run"]
    # 50% targets: 0.4, 0.4, 0.45. spi8 (5 tokens a step) reaches 0.4 at step 20: 100 tokens against
    # on_policy's 400 (step 10) on seeds 0 and 1.
    assert rows["spi8"]["seeds that reach it"] == "2/2"
    assert rows["spi8"]["generated tokens"] == "0.25 [0.25, 0.25]; IQM 0.25 [0.25, 0.25]"


@pytest.mark.parametrize("mu", [MEASURED_MU, 5.28, 6.84])
def test_compute_at_mu_is_trained_plus_mu_generated_rollouts_over_the_same_seeds_baseline(md, mu):
    row = markdown_tables(md)[TARGET_90]["spi2"]
    label = f"compute at measured µ = {mu:g}" if mu == MEASURED_MU else f"compute at µ = {mu:g}"
    # spi2 trains 4 and generates 2 a step; on_policy 4 and 4: seed 0 at steps 10 vs 20, seed 1 at 20 vs 30.
    ratios = [(40 + mu * 20) / (80 + mu * 80), (80 + mu * 40) / (120 + mu * 120)]
    assert _numbers(row[label])[:2] == pytest.approx([max(ratios), min(ratios) + 0.5 * abs(ratios[1] - ratios[0])],
                                                     rel=5e-3)


def test_paired_differences_subtract_the_baseline_run_of_the_same_seed(md):
    rows = markdown_tables(md)["Paired by seed: each run minus the on_policy run of the same seed"]
    assert set(rows) == {"spi2", "spi8"}  # the baseline is not paired with itself
    peaks = {"on_policy": [0.6, 0.6, 0.7], "spi2": [0.7, 0.65, 0.55], "spi8": [0.5, 0.45]}
    spi2 = np.subtract(peaks["spi2"], peaks["on_policy"])  # 0.1, 0.05, -0.15
    assert rows["spi2"]["seeds paired"] == "3" and rows["spi8"]["seeds paired"] == "2"
    cell = _column(rows["spi2"], "peak")
    assert _numbers(cell)[:3] == pytest.approx(_iqr(spi2), rel=5e-3)
    assert cell.endswith("above in 2/3")
    assert _numbers(_column(rows["spi8"], "final"))[:3] == pytest.approx(_iqr([0.0, -0.15]), rel=5e-3)
    # pass@4 exists for on_policy seeds 0 and 1 and spi2 seed 0: one pair.
    assert _column(rows["spi2"], "pass@4") == "0.1; above in 1/1"
    assert _column(rows["spi8"], "pass@4") == "n/a"


def _iqm_by_hand(values):
    """Cut floor(n/4) values from each end of the sorted values, average the rest."""
    v = sorted(values)
    cut = len(v) // 4
    return sum(v[cut:len(v) - cut]) / (len(v) - 2 * cut)


def _ci_by_hand(strata, reps=10_000, seed=0):
    """The documented bootstrap: per replicate, every stratum redrawn with replacement
    (indices from default_rng(seed).integers(0, n, (reps, n)), stratum after stratum)."""
    rng = np.random.default_rng(seed)
    draws = [rng.integers(0, len(s), size=(reps, len(s))) for s in strata]
    stats = [_iqm_by_hand([strata[j][i] for j, d in enumerate(draws) for i in d[r]]) for r in range(reps)]
    return np.percentile(stats, 2.5), np.percentile(stats, 97.5)


def test_iqm_and_its_stratified_bootstrap_interval_by_hand():
    values = [0.3, -0.1, 0.05, 0.2, 0.0, 0.12, -0.4, 0.08]
    assert iqm(values) == pytest.approx((0.0 + 0.05 + 0.08 + 0.12) / 4)  # the middle four of eight
    assert iqm([1, 2, 3]) == pytest.approx(2) and iqm([5, 1, 100, 2]) == pytest.approx(3.5)
    strata = [values[:5], values[5:]]
    assert bootstrap_ci(strata) == pytest.approx(_ci_by_hand(strata))
    # Every replicate's IQM lies between the smallest and largest value, and the interval holds the IQM.
    lo, hi = bootstrap_ci(strata)
    assert -0.4 <= lo < iqm(values) < hi <= 0.3


def test_the_report_prints_the_iqm_and_interval_of_paired_differences_on_made_up_runs(tmp_path):
    """Four seeds each of on_policy and spi4 with known peaks: the paired peak differences, their
    IQM (the middle two) and the bootstrap interval, all computed here."""
    base = [0.5, 0.6, 0.55, 0.7]
    spi = [0.45, 0.62, 0.5, 0.75]
    dirs = []
    for seed, (b, r) in enumerate(zip(base, spi)):
        dirs.append(_run_dir(tmp_path, "on_policy", seed, [0.2, 0.3, b, b], 0.5, 1.0))
        dirs.append(_run_dir(tmp_path, "spi2", seed, [0.2, 0.3, r, r], 0.5, 1.0))
    report(dirs, tmp_path / "out")
    row = markdown_tables((tmp_path / "out" / "report.md").read_text())[
        "Paired by seed: each run minus the on_policy run of the same seed"]["spi2"]
    diffs = list(np.subtract(spi, base))  # -0.05, 0.02, -0.05, 0.05
    lo, hi = _ci_by_hand([diffs])
    med, q1, q3 = _iqr(diffs)
    expected = (f"{med:.3g} [{q1:.3g}, {q3:.3g}]; IQM {_iqm_by_hand(diffs):.3g} [{lo:.3g}, {hi:.3g}]; "
                "above in 2/4")
    assert _column(row, "peak") == expected


def test_pass_at_k_comes_from_eval_json(md):
    table = markdown_tables(md)["pass@k of the final policy (`jaxreplay eval ... --out RUN_DIR/eval.json`)"]
    on = table["on_policy (baseline)"]
    assert on["runs with eval.json"] == "2"
    assert _numbers(on["pass@4 (T 1.0)"]) == pytest.approx(_iqr([0.5, 0.55]), rel=5e-3)
    assert _numbers(on["pass@1 (T 0.1)"]) == pytest.approx(_iqr([0.32, 0.32]))
    assert table["spi2"]["pass@16 (T 1.0)"] == "0.8" and table["spi8"]["pass@16 (T 1.0)"] == "n/a"


STEMS = ("accuracy_vs_tokens", "accuracy_vs_steps", "accuracy_vs_flops", "accuracy_vs_wallclock",
         "accuracy_vs_compute_measured_mu", "accuracy_vs_compute_mu5_28", "accuracy_vs_compute_mu6_84", "entropy",
         "drift_approx_kl", "drift_clipfrac", "staleness", "staleness_hist", "replay_ratio", "pass_at_k")


def test_every_plot_is_written_titled_and_linked(sweep_dirs, out, md):
    settings = group_settings(load_runs(sweep_dirs))
    mus = [("measured µ = 0.5", 0.5), ("µ = 5.28", 5.28), ("µ = 6.84", 6.84)]
    titles = {stem: fig.axes[0].get_title() for stem, fig in report_plots.figures(settings, 0.6, mus)}
    assert sorted(titles) == sorted(STEMS)
    for stem, title in titles.items():
        assert title, f"{stem} has no title"
        image = matplotlib.image.imread(out / f"{stem}.png")
        assert image.shape[0] > 300 and image.shape[1] > 500 and image[..., :3].std() > 0.01, stem
        assert f"### {title}\n\n![{title}]({stem}.png)" in md
    assert "IQR" in titles["accuracy_vs_tokens"] and "µ = 5.28" in titles["accuracy_vs_compute_mu5_28"]
    assert (out / "runs" / "spi2" / "seed0" / "summary.json").exists()


def test_reference_lines_mark_the_target_ratio_and_the_horizon(sweep_dirs):
    settings = group_settings(load_runs(sweep_dirs))
    figs = dict(report_plots.figures(settings, 0.6, []))
    flat = lambda ax: {float(line.get_ydata()[0]) for line in ax.lines if len(set(line.get_ydata())) == 1}
    assert {1.0, 2.0, 8.0} <= flat(figs["replay_ratio"].axes[0])
    staleness = figs["staleness"].axes[0]
    assert {16.0, 32.0} <= flat(staleness)
    assert {t.get_text() for t in staleness.texts} == {"spi2: N/R = 8 actor steps = 16 learner steps",
                                                      "spi8: N/R = 4 actor steps = 32 learner steps"}


def test_curves_of_seeds_meet_on_a_common_grid_by_linear_interpolation():
    a = (np.array([0.0, 10, 20]), np.array([0.0, 1, 2]))
    b = (np.array([0.0, 5, 15]), np.array([0.0, 1, 3]))
    grid, q1, med, q3 = band([a, b])
    assert grid.tolist() == [0, 5, 10, 15]  # both cover [0, 15]; 20 only a does
    assert med.tolist() == pytest.approx([0, 0.75, 1.5, 2.25])  # a: 0, .5, 1, 1.5; b: 0, 1, 2, 3
    assert q1.tolist() == pytest.approx([0, 0.625, 1.25, 1.875])


def test_wall_clock_leaves_out_compilation():
    def run(keys):
        records = [{"step": 0, "eval/accuracy": 0.1}]
        records += [{"step": s, **{k: f(s) for k, f in keys.items()}} for s in (1, 2, 3)]
        return RunData(dir=None, config={}, records=records)

    cumulative = {"time/generate_s": lambda s: 20 + s, "time/train_s": lambda s: 30 + 2 * s,
                  "time/replay_s": lambda s: 0.1 * s}
    timed = {**cumulative, "time/generate_timed_s": lambda s: s - 1, "time/train_timed_s": lambda s: 2 * (s - 1)}
    # The accounting's timed seconds, where logged: 3 * (3 - 1) + 0.3.
    assert run(timed).x("wallclock", [0, 1, 3]).tolist() == pytest.approx([0, 0.1, 6.3])
    # Otherwise counted from the first learner step, which holds both compiling calls: (53.3 - 33.1).
    assert run(cumulative).x("wallclock", [0, 1, 3]).tolist() == pytest.approx([0, 0, 6.2])


def test_runs_that_predate_the_rollout_counters_use_inserts_and_steps_times_batch():
    records = [{"step": 0, "eval/accuracy": 0.1}, {"step": 5, "replay/inserts": 8, "eval/accuracy": 0.2}]
    run = RunData(dir=None, config={"train": {"batch_size": 4}}, records=records)
    assert run.x("compute", [0, 5], mu=2.0).tolist() == [0, 5 * 4 + 2.0 * 8]


def test_runs_that_never_measured_mu_are_modelled_at_the_given_mu_only(tmp_path):
    dirs = [_run_dir(tmp_path, "on_policy", 0, [0.2, 0.4, 0.6, 0.5], None, 1.0),
            _run_dir(tmp_path, "spi2", 0, [0.2, 0.6, 0.7, 0.7], None, 1.0)]
    report(dirs, tmp_path / "none")
    md = (tmp_path / "none" / "report.md").read_text()
    assert "No run logged cost/mu" in md and "compute at" not in md
    assert not list((tmp_path / "none").glob("accuracy_vs_compute*"))
    report(dirs, tmp_path / "given", mus=(5.28,))
    row = markdown_tables((tmp_path / "given" / "report.md").read_text())[TARGET_90]["spi2"]
    # spi2 reaches seed 0's 0.56 at step 10, on_policy at step 20.
    assert _numbers(row["compute at µ = 5.28"]) == pytest.approx([(40 + 5.28 * 20) / (80 + 5.28 * 80)], rel=5e-3)
    assert sorted(p.name for p in (tmp_path / "given").glob("accuracy_vs_compute*")) == \
        ["accuracy_vs_compute_mu5_28.png"]


def test_a_folder_without_metrics_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="not a run dir"):
        load_runs([tmp_path])


@pytest.mark.parametrize("text", ["0", "-1", "abc", "5.28,", "nan", "inf"])
def test_mu_must_be_positive_numbers(text):
    with pytest.raises(ConfigError, match="--mu"):
        parse_mus(text)
    assert parse_mus("5.28,6.84") == (5.28, 6.84) and parse_mus(None) == ()


@pytest.mark.parametrize("mu", ["-1", "abc", "0,5.28"])
def test_the_cli_refuses_a_bad_mu_with_one_line_and_exit_2(sweep_dirs, tmp_path, mu):
    out = subprocess.run([sys.executable, "-m", "jaxreplay.cli", "report", *map(str, sweep_dirs), "--out",
                          str(tmp_path / "out"), f"--mu={mu}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "--mu" in out.stderr and not (tmp_path / "out").exists()


CLAIMS = """
claims:
  keeps_peak:
    text: spi 2 keeps the peak
    settings: [spi2]
    measure: peak
    above: -0.2
  beats_peak:
    text: spi 2 raises the peak
    settings: [spi2]
    measure: peak
    above: 0.2
  faster:
    text: spi 2 reaches 90% of the gain with fewer tokens
    settings: [spi2]
    measure: tokens_to_90
    below: 1.0
  spi8_peak:
    text: spi 8 keeps the peak
    settings: [spi8]
    measure: peak
    above: -0.01
    ceiling: 0.55
"""


def _sweep_file(tmp_path, root):
    path = tmp_path / "sweep.yaml"
    path.write_text(f"base: {ROOT / 'configs' / 'demo.yaml'}\nout: {root}\nseeds: [0, 1, 2]\n"
                    "settings:\n  on_policy: [replay.mode=on_policy]\n  spi2: []\n  spi8: []\n" + CLAIMS)
    return path


def test_claims_get_verdicts_from_the_rules_the_sweep_file_declared(sweep_dirs, tmp_path):
    report(sweep_dirs, tmp_path / "out", sweep=_sweep_file(tmp_path, tmp_path / "runs"))
    rows = markdown_tables((tmp_path / "out" / "report.md").read_text())["Claims and verdicts"]
    keeps = rows["spi 2 keeps the peak"]
    # Paired peak differences 0.1, 0.05, -0.15: IQM (three seeds: nothing cut) 0; a replicate of
    # three -0.15 (1 in 27) puts the 2.5% point at -0.15, three 0.1 the 97.5% point at 0.1.
    assert keeps["rule (declared in the sweep file)"] == "paired IQM of peak − on_policy's > -0.2"
    assert keeps["paired numbers"] == "IQM 0 [-0.15 ±0, 0.1 ±0] over 3 paired seeds; above on_policy in 2/3"
    assert keeps["verdict"] == "holds"
    assert rows["spi 2 raises the peak"]["verdict"] == "fails"
    faster = rows["spi 2 reaches 90% of the gain with fewer tokens"]  # 0.25, 0.333, never
    assert faster["paired numbers"].startswith("IQM > budget [0.25 ±0, > budget]") and faster["verdict"] == "inconclusive"
    assert faster["paired numbers"].endswith("reached in 2/3")
    assert rows["spi 8 keeps the peak"]["verdict"] == \
        "not testable here: on_policy's median peak is 0.6, at or above the ceiling 0.55"


def test_a_sweep_writes_its_claims_before_any_run_and_a_bad_claim_is_refused(tmp_path):
    from jaxreplay.research.sweep import load_sweep, run_sweep

    sweep = load_sweep(_sweep_file(tmp_path, tmp_path / "runs"))
    assert set(sweep.claims) == {"keeps_peak", "beats_peak", "faster", "spi8_peak"}
    for run in sweep.runs:  # all finished: the sweep skips them, but writes its claims first
        run.dir.mkdir(parents=True)
        (run.dir / "summary.json").write_text(json.dumps({"steps": run.config.train.steps}))
    run_sweep(sweep, log=lambda _: None)
    assert yaml.safe_load((tmp_path / "runs" / "claims.yaml").read_text()) == yaml.safe_load(CLAIMS)["claims"]
    bad = _sweep_file(tmp_path, tmp_path / "runs")
    bad.write_text(bad.read_text().replace("settings: [spi8]", "settings: [spi16]"))
    with pytest.raises(ConfigError, match="sweep.claims.spi8_peak.settings: spi16 is not one of the settings"):
        load_sweep(bad)
    bad.write_text(bad.read_text().replace("measure: tokens_to_90", "measure: tokens_to_80"))
    with pytest.raises(ConfigError, match="sweep.claims.faster.measure"):
        load_sweep(bad)


def test_the_report_rebuilds_byte_for_byte_from_its_copied_runs_alone(tmp_path):
    """Report a sweep, delete its run dirs, report again from OUT/runs: identical report and plots."""
    root = tmp_path / "sweep"
    dirs = [_run_dir(root, *run) for run in RUNS]
    (dirs[0] / "eval.json").write_text(json.dumps({"pass@1_t0.1": 0.3, "pass@k_t1.0": {"1": 0.3, "4": 0.5}}))
    (dirs[0] / "checkpoints" / "30").mkdir(parents=True)  # never copied: not read by the report
    with open(dirs[0] / "metrics.jsonl", "a") as f:  # keys no table reads are trimmed away
        f.write(json.dumps({"step": 31, "loss": 0.5, "grad_norm": 1.0}) + "\n")
    (root / "claims.yaml").write_text(yaml.safe_dump(yaml.safe_load(CLAIMS)["claims"]))
    first = tmp_path / "first"
    report(dirs, first, mus=(5.28,))
    shutil.rmtree(root)
    copies = sorted(p for p in (first / "runs").glob("*/*") if p.is_dir())
    assert [p.relative_to(first / "runs").as_posix() for p in copies] == \
        [f"{s}/seed{n}" for s, n, *_ in RUNS]
    assert not (first / "runs" / "on_policy" / "seed0" / "checkpoints").exists()
    kept = [json.loads(line) for line in (first / "runs" / "on_policy" / "seed0" / "metrics.jsonl").open()]
    assert kept[-1]["step"] == 30 and "eval/accuracy" in kept[-1] and not any("loss" in r for r in kept)
    second = tmp_path / "second"
    report(copies, second, mus=(5.28,))
    md = (first / "report.md").read_text()
    assert (second / "report.md").read_text() == md
    assert "Claims and verdicts" in md and str(tmp_path) not in md
    for png in first.glob("*.png"):
        assert (second / png.name).read_bytes() == png.read_bytes(), png.name
    report(copies, first, mus=(5.28,))  # in place, as results/*/ are rebuilt
    assert (first / "report.md").read_text() == md


def test_coverage_compares_the_baselines_compute_with_the_most_any_other_run_reached(md):
    rows = markdown_tables(md)["Compute budget coverage"]
    # At µ = 5.28 on_policy ends at 120 trained + 5.28 x 120 generated rollouts, spi2 (the most) at
    # 120 + 5.28 x 60; to cover spi8 at equal tokens it would need (8 + 5.28)/(1 + 5.28) their tokens.
    row = rows["µ = 5.28"]
    assert _numbers(_column(row, "on_policy's median final compute")) == \
        pytest.approx([(120 + 5.28 * 120) / (120 + 5.28 * 60)], rel=5e-3)
    assert _column(row, "on_policy's median final compute").endswith("(full)")
    assert _numbers(_column(row, "(y_max + µ)/(1 + µ)")) == pytest.approx([(8 + 5.28) / 6.28], rel=5e-3)
