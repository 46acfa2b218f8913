"""`jaxreplay report` on synthetic run dirs whose every reported number is computed by hand here.

Three settings, R = 4 rollouts per actor step, B = 4, evaluations at steps 0, 10, 20, 30:
- on_policy (3 seeds): 4 rollouts generated and 4 trained per step, 10 tokens per rollout;
- spi2 (3 seeds): 2 generated and 4 trained per step; max_size 32 (N/R = 8, 16 learner steps);
- spi8 (2 seeds): 0.5 generated and 4 trained per step; max_size 16 (N/R = 4, 32 learner steps).
The on-policy median curve (tokens identical across its seeds) is 0.2, 0.4, 0.6, 0.6 at
0, 400, 800, 1200 tokens: the baseline peak is 0.6. Its seeds reach it at steps 20, 30, 20,
so the baseline spent (median) what step 20 costs: 800 tokens, 80 (1 + mu) compute units.
"""

import json
import re
import subprocess
import sys

import matplotlib.image
import numpy as np
import pytest
import yaml

from jaxreplay.config import ConfigError
from jaxreplay.research import report_plots
from jaxreplay.research.report import baseline_peak, report
from jaxreplay.research.report_data import RunData, group_settings, load_runs, pick_baseline
from jaxreplay.research.report_stats import band, parse_mus

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


def _tables(md):
    """{section heading: {row label: {column header: cell}}} of report.md's tables."""
    tables, heading, header = {}, None, None
    for line in md.splitlines():
        if line.startswith("## "):
            heading, header = line[3:], None
        elif line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            if header is None:
                header = cells
            else:
                tables.setdefault(heading, {})[cells[0]] = dict(zip(header, cells))
    return tables


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
    assert baseline_peak(settings[0]) == pytest.approx(0.6)
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
    rows = _tables(md)["Per setting"]
    on, spi8 = rows["on_policy (baseline)"], rows["spi8"]
    assert _numbers(on["peak eval accuracy"]) == pytest.approx([0.6, 0.6, 0.65])
    assert _numbers(on["final eval accuracy"]) == pytest.approx([0.6, 0.55, 0.65])
    assert _numbers(spi8["peak eval accuracy"]) == pytest.approx([0.475, 0.4625, 0.4875], abs=6e-4)
    # Steps 21..30 average to entropy0 - 0.255: seeds 0.745, 0.845, 0.945 (the last value alone would be 0.1 less).
    assert _numbers(_column(on, "entropy at end")) == pytest.approx([0.845, 0.795, 0.895])
    # median [IQR] (target) of the last replay/ratio, spi * 30 / 31 in every seed
    assert _numbers(_column(rows["spi2"], "replay ratio")) == pytest.approx([60 / 31] * 3 + [2], rel=5e-3)
    assert "median over a setting's seeds, with the interquartile range" in md


def test_tokens_to_the_baseline_peak_are_multiples_of_the_baseline_median(md):
    rows = _tables(md)["Per setting"]
    # Baseline seeds reach 0.6 at 800, 1200, 800 tokens; the reference is their median, 800.
    assert _numbers(_column(rows["on_policy (baseline)"], "tokens to")) == pytest.approx([*_iqr([1, 1.5, 1]), 3, 3])
    # spi2 reaches it at 200 (step 10) and 400 tokens (step 20); its third seed never does.
    assert _numbers(_column(rows["spi2"], "tokens to")) == pytest.approx([*_iqr([0.25, 0.5]), 2, 3], rel=5e-3)
    assert _column(rows["spi8"], "tokens to") == "never reaches 0.600 (0/2)"
    assert "tokens to on_policy peak 0.600 (multiple of 800 tokens)" in md


@pytest.mark.parametrize("mu", [MEASURED_MU, 5.28, 6.84])
def test_compute_at_mu_is_trained_plus_mu_generated_rollouts_as_a_multiple_of_the_baseline(md, mu):
    table = _tables(md)["Compute to the baseline peak, × the baseline's"]
    label = f"measured µ = {mu:g}" if mu == MEASURED_MU else f"µ = {mu:g}"
    ref = 4 * 20 + mu * 4 * 20  # the baseline at step 20: 80 trained and 80 generated rollouts
    header = f"{label} (× {ref:.3g} units)"
    spi2 = [(4 * s + mu * 2 * s) / ref for s in (10, 20)]  # 4 trained and 2 generated per step
    assert _numbers(table["spi2"][header]) == pytest.approx([*_iqr(spi2), 2, 3], rel=5e-3)
    assert _numbers(table["on_policy (baseline)"][header]) == pytest.approx([*_iqr([1, 1.5, 1]), 3, 3])
    assert table["spi8"][header] == "never reaches 0.600 (0/2)"


def test_the_main_table_models_compute_at_the_measured_mu_and_the_first_given(md):
    row = _tables(md)["Per setting"]["spi2"]
    measured = _column(row, f"compute to on_policy peak at measured µ = {MEASURED_MU:g}")
    at_528 = _column(row, "compute to on_policy peak at µ = 5.28")
    assert _numbers(measured)[0] == pytest.approx(np.median([(40 + 10) / 120, (80 + 20) / 120]), rel=5e-3)
    assert _numbers(at_528)[0] == pytest.approx(np.median([(40 + 5.28 * 20) / 502.4, (80 + 5.28 * 40) / 502.4]),
                                                 rel=5e-3)
    assert not [k for k in row if "6.84" in k]


def test_speed_is_accuracy_at_shares_of_the_common_token_budget_and_stability_the_largest_fall(md):
    """Every run spent at least 150 tokens (spi8's 30 steps x 5): accuracy is read at 37.5, 75 and
    150 tokens, interpolated between evaluations (on-policy evaluates at 0 and 400 tokens)."""
    rows = _tables(md)["Learning speed and stability"]
    on_policy = [np.interp([37.5, 75, 150], [0, 400], [0.2, acc]) for acc in (0.4, 0.5, 0.3)]
    assert _numbers(_column(rows["on_policy (baseline)"], "accuracy at 100% of 150"))[:3] == \
        pytest.approx(_iqr([a[2] for a in on_policy]), rel=5e-3)
    assert _numbers(_column(rows["spi8"], "accuracy at 25%"))[:3] == pytest.approx(_iqr([0.275, 0.275]), rel=5e-3)
    assert _numbers(_column(rows["spi8"], "accuracy at 100%"))[:3] == pytest.approx(_iqr([0.5, 0.45]), rel=5e-3)
    falls = {"on_policy (baseline)": [0.1, 0, 0], "spi2": [0, 0.05, 0], "spi8": [0, 0]}
    for name, values in falls.items():
        assert _numbers(_column(rows[name], "largest fall"))[:3] == pytest.approx(_iqr(values), abs=1e-9)


def test_paired_differences_subtract_the_baseline_run_of_the_same_seed(md):
    rows = _tables(md)["Paired by seed: each run minus the on_policy run of the same seed"]
    assert set(rows) == {"spi2", "spi8"}  # the baseline is not paired with itself
    peaks = {"on_policy": [0.6, 0.6, 0.7], "spi2": [0.7, 0.65, 0.55], "spi8": [0.5, 0.45]}
    spi2 = np.subtract(peaks["spi2"], peaks["on_policy"])
    assert rows["spi2"]["seeds paired"] == "3" and rows["spi8"]["seeds paired"] == "2"
    assert _numbers(_column(rows["spi2"], "peak accuracy"))[:3] == pytest.approx(_iqr(spi2), rel=5e-3)
    assert _numbers(_column(rows["spi8"], "final accuracy"))[:3] == pytest.approx(_iqr([0.0, -0.15]), rel=5e-3)
    # pass@4 exists for on_policy seeds 0 and 1 and spi2 seed 0: one pair.
    assert _numbers(_column(rows["spi2"], "pass@4")) == pytest.approx([0.6 - 0.5])
    assert _column(rows["spi8"], "pass@4") == "n/a"


def test_pass_at_k_comes_from_eval_json(md):
    table = _tables(md)["pass@k of the final policy (`jaxreplay eval ... --out RUN_DIR/eval.json`)"]
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
    assert "No µ: no run logged cost/mu and none was given" in (tmp_path / "none" / "report.md").read_text()
    assert not list((tmp_path / "none").glob("accuracy_vs_compute*"))
    report(dirs, tmp_path / "given", mus=(5.28,))
    row = _tables((tmp_path / "given" / "report.md").read_text())["Per setting"]["spi2"]
    assert _numbers(_column(row, "compute to on_policy peak at µ = 5.28")) == \
        pytest.approx([(40 + 5.28 * 20) / (80 + 5.28 * 80), 1, 1], rel=5e-3)
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
