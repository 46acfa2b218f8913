"""The replay cost model: closed form, numeric check, and the Reverb settings it implies."""

import math

import pytest

from jaxreplay.theory import cost, describe, numeric_optimum, optimum, replay_ratio, reverb_settings


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
    assert s == {"replay.mode": "replay", "replay.max_size": round(14.319 * 64), "replay.samples_per_insert": 5.576}
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
