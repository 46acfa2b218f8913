"""The replay cost model: closed form, numeric check, and the Reverb settings it implies."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from jaxreplay.config import load_config
from jaxreplay.replay.theory import (
    PAPER_TABLE_GAMMA, cost, describe, fit_table, numeric_optimum, optimum, realised_horizon, replay_ratio,
    reverb_settings, split_compute_ratio)
from jaxreplay.train.calibrate import horizon_mismatch

ROOT = Path(__file__).resolve().parents[1]


def test_paper_constants_give_a_staleness_horizon_of_14_and_a_replay_ratio_of_5_6():
    opt = optimum(mu=5.28, rho=0.1, alpha=0.1)
    assert opt.x == pytest.approx(14.32, abs=0.01)
    assert opt.y == pytest.approx(5.576, abs=0.001)
    assert not opt.on_policy


def test_high_rho_makes_on_policy_optimal():
    opt = optimum(mu=5.28, rho=1.0, alpha=0.2)
    assert opt.x == pytest.approx(0.92, abs=0.005)
    assert opt.on_policy
    assert reverb_settings(opt, 64) == {"replay.mode": "on_policy"}


@pytest.mark.parametrize("mu,rho,alpha", [(5.28, 0.1, 0.1), (5.28, 1.0, 0.2), (2.0, 0.3, 0.25), (7.0, 0.05, 0.05)])
def test_closed_form_is_the_minimiser_of_the_cost(mu, rho, alpha):
    closed, numeric = optimum(mu, rho, alpha), numeric_optimum(mu, rho, alpha)
    assert numeric.x == pytest.approx(closed.x, rel=1e-6)
    assert numeric.y == pytest.approx(closed.y, rel=1e-6)
    for x in (closed.x * 0.9, closed.x * 1.1):
        assert cost(x, mu, rho, alpha) > cost(closed.x, mu, rho, alpha)


def test_optimal_ratio_is_the_best_ratio_at_the_optimal_horizon():
    opt = optimum(5.28, 0.1, 0.1)
    assert replay_ratio(5.28, 0.1, opt.x) == pytest.approx(opt.y, rel=1e-9)
    assert opt.compute_ratio == pytest.approx((1 + 5.28 / opt.y) / (1 + 5.28))


def test_reverb_settings_scale_the_horizon_by_rollouts_per_step():
    s = reverb_settings(optimum(5.28, 0.1, 0.1), rollouts_per_step=64)
    assert s == {"replay.mode": "replay", "replay.max_size": round(14.319 * 64), "replay.samples_per_insert": 5.576,
                 "train.batch_size": round(5.576 * 64)}
    text = describe(optimum(5.28, 0.1, 0.1), 64)
    assert "x* = 14.32" in text and "y* = 5.576" in text and "replay.max_size=916" in text


@pytest.mark.parametrize("mu,rho,alpha", [(0, 0.1, 0.1), (5, 0, 0.1), (5, 0.1, 0.5), (5, 0.1, 0)])
def test_outside_the_model_is_refused(mu, rho, alpha):
    with pytest.raises(ValueError):
        optimum(mu, rho, alpha)
    assert math.isfinite(cost(1.0, 5.0, 0.1, 0.1))


def test_cheap_generation_is_flagged_as_saving_nothing():
    # mu = 0.3 (what this repo's CPU demo measures): y* < 1, so gamma > 1.
    opt = optimum(0.3, 0.1, 0.1)
    assert opt.y < 1 and opt.compute_ratio > 1
    assert "replay saves no compute" in describe(opt, 64)


@pytest.mark.parametrize("split,paper_gamma", [((7, 1), 1.29), ((6, 2), 0.65), ((5, 3), 0.43), ((4, 4), 0.32)])
def test_device_split_compute_ratio_matches_the_papers_table_1(split, paper_gamma):
    assert split_compute_ratio(*split, mu=5.28) == pytest.approx(paper_gamma, abs=0.03)


def test_both_ways_of_setting_a_run_realise_the_optimal_horizon():
    opt = optimum(5.28, 0.1, 0.1)
    for batch_size in (None, 64, 512):
        s = reverb_settings(opt, rollouts_per_step=64, batch_size=batch_size)
        realised = realised_horizon(s["replay.max_size"], s["train.batch_size"], s["replay.samples_per_insert"])
        assert realised == pytest.approx(opt.x, rel=0.02), (batch_size, s)
    # The model's own batch: one learner update per actor step, B = y*R, kept a multiple of the unit.
    assert reverb_settings(opt, 64, batch_unit=8)["train.batch_size"] == 360
    # The old advice (N = x*R at the default B = R = 64) spans y* times the horizon.
    assert realised_horizon(round(opt.x * 64), 64, opt.y) == pytest.approx(opt.y * opt.x, rel=0.01)


def test_theory_command_prints_the_batch_size_and_the_device_split_table():
    out = subprocess.run([sys.executable, "-m", "jaxreplay.cli", "theory", "--mu", "5.28", "--rho", "0.1", "--alpha",
                          "0.1", "--rollouts-per-step", "64", "--batch-size", "64"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # y*R = 356.9 rollouts, rounded to whole groups of the demo's 8.
    assert "train.batch_size=360 replay.max_size=916" in out.stdout
    assert "train.batch_size=64 replay.max_size=164" in out.stdout
    assert "  6  2  0.64" in out.stdout and "gamma = (1 + W/T)/(1 + mu)" in out.stdout


def _theory(*args):
    return subprocess.run([sys.executable, "-m", "jaxreplay.cli", "theory", *args], capture_output=True, text=True,
                          timeout=120)


def test_the_demo_group_size_is_the_default_batch_unit():
    from jaxreplay.research.commands import DEMO_GROUP_SIZE

    assert load_config(ROOT / "configs" / "demo.yaml").train.group_size == DEMO_GROUP_SIZE


def test_a_config_gives_the_group_size_rollouts_and_batch_size(tmp_path):
    import yaml

    raw = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    raw["train"].update(group_size=6, prompts_per_step=10, batch_size=60)  # R = 60
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    out = _theory("--mu", "5.28", "--rho", "0.1", "--alpha", "0.1", "--config", str(tmp_path / "c.yaml"))
    assert out.returncode == 0, out.stderr
    # y*R = 5.576 * 60 = 334.6: the nearest multiple of 6 is 336; at the config's B = 60, N = x*B/y* = 154.
    assert "R=60" in out.stdout and "train.batch_size=336 replay.max_size=859" in out.stdout
    assert "train.batch_size=60 replay.max_size=154" in out.stdout


def test_both_gamma_forms_are_printed_with_the_y_each_implies():
    out = _theory("--mu", "5.28", "--rho", "0.1", "--alpha", "0.1")
    assert out.returncode == 0, out.stderr
    # (1 + W/T)/(1 + mu) equals (1 + mu/y)/(1 + mu) at y = mu T/W: 5.28 * 2/6 = 1.76 for (6,2);
    # the paper's measured y = 2.2 there gives (1 + 5.28/2.2)/6.28 = 0.54.
    row = next(line for line in out.stdout.splitlines() if line.startswith("  6  2"))
    assert row.split()[2:5] == ["0.64", "1.76", "|"] and row.split()[5:] == ["2.2", "0.54"]
    assert "W/T = mu/y* = 0.947" in out.stdout  # 5.28 / 5.576


def test_table_1_is_fit_by_mu_5_2_not_5_28():
    fit = fit_table()
    assert fit.mu == pytest.approx(5.195, abs=0.001)
    assert fit.lo == pytest.approx(8 / 1.295 - 1) and fit.hi == pytest.approx(4 / 0.645 - 1)  # (7,1) and (6,2) bind
    assert fit.lo < 5.2 < fit.hi < 5.28
    for split, gamma in PAPER_TABLE_GAMMA.items():
        assert round(split_compute_ratio(*split, mu=fit.mu), 2) == gamma
    assert [round(split_compute_ratio(*s, mu=5.28), 2) for s in PAPER_TABLE_GAMMA] == [1.27, 0.64, 0.42, 0.32]


def test_fit_table_needs_no_other_flag():
    out = _theory("--fit-table")
    assert out.returncode == 0, out.stderr
    assert "mu = 5.195 (least squares)" in out.stdout and "[5.178, 5.202]" in out.stdout


def test_several_mu_print_one_optimum_each_and_missing_constants_are_refused():
    out = _theory("--mu", "5.28,6.84", "--rho", "0.1", "--alpha", "0.1")
    assert out.returncode == 0 and out.stdout.count("cost model: mu=") == 2, out.stderr
    assert "mu=6.84" in out.stdout
    out = _theory("--mu", "5.28")
    assert out.returncode == 2 and out.stderr.strip() == \
        "jaxreplay: config error: theory: --rho and --alpha required (or --fit-table)"


@pytest.mark.parametrize("args", [["--mu", "0"], ["--mu", "nan"], ["--rho", "inf"], ["--alpha", "0.5"],
                                  ["--rollouts-per-step", "0"], ["--batch-size", "-4"]])
def test_theory_command_refuses_bad_input_with_one_line_and_exit_2(args):
    base = {"--mu": "5.28", "--rho": "0.1", "--alpha": "0.1"}
    base.update(dict(zip(args[::2], args[1::2])))
    out = subprocess.run([sys.executable, "-m", "jaxreplay.cli", "theory", *sum(base.items(), ())],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert args[0] in out.stderr


def test_calibration_says_when_the_batch_size_does_not_realise_the_horizon():
    config = load_config(ROOT / "configs" / "demo.yaml", ["replay.max_size=512"])  # R = 64, B = 64
    assert "realises a staleness horizon of 16 learner steps, not the modelled x = N/R = 8" in \
        horizon_mismatch(config, 2.0)
    matched = load_config(ROOT / "configs" / "demo.yaml", ["replay.max_size=512", "train.batch_size=128"])
    assert horizon_mismatch(matched, 2.0) == ""
