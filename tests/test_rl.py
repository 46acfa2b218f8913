"""Advantage and loss maths on small hand-checked examples."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.rl import group_normalized, grpo_clip_loss, kl_penalty, masked_mean


def test_group_normalized_advantages():
    # Group 1: rewards 1,0,0,1 -> mean .5, std .5 -> +1,-1,-1,+1. Group 2: all equal -> 0.
    adv = group_normalized(np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]))
    np.testing.assert_allclose(adv, [[1, -1, -1, 1], [0, 0, 0, 0]], atol=1e-5)


def test_group_normalized_is_per_group_not_per_batch():
    adv = group_normalized(np.array([[3.0, 1.0], [0.0, 0.0]]))
    np.testing.assert_allclose(adv, [[1, -1], [0, 0]], atol=1e-5)


def test_masked_mean_counts_only_masked_tokens():
    x = jnp.array([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = jnp.array([[True, True, False], [True, False, False]])
    assert float(masked_mean(x, mask)) == pytest.approx(2.0)


def test_grpo_loss_on_policy_equals_minus_mean_advantage():
    # ratio = 1 everywhere: loss = -token-mean of advantages, nothing clipped, KL 0.
    lp = jnp.log(jnp.array([[0.5, 0.25], [0.5, 0.5]]))
    mask = jnp.array([[True, True], [True, False]])
    loss, m = grpo_clip_loss(lp, lp, jnp.array([2.0, -1.0]), mask, eps_low=0.2, eps_high=0.2)
    assert float(loss) == pytest.approx(-(2.0 + 2.0 - 1.0) / 3)
    assert float(m["pg_clipfrac"]) == 0.0
    assert float(m["approx_kl"]) == pytest.approx(0.0, abs=1e-7)


def test_grpo_clipping_by_hand():
    # Token ratios 1.5 (A=+1 -> clipped at 1.2), 0.5 (A=-1 -> clipped at 0.8, min picks -0.8),
    # 1.1 (A=+1, inside the band), 0.5 (A=+1 -> unclipped 0.5 is the min).
    behaviour = jnp.zeros((4, 1))
    lp = jnp.log(jnp.array([[1.5], [0.5], [1.1], [0.5]]))
    adv = jnp.array([1.0, -1.0, 1.0, 1.0])
    mask = jnp.ones((4, 1), bool)
    loss, m = grpo_clip_loss(lp, behaviour, adv, mask, eps_low=0.2, eps_high=0.2)
    assert float(loss) == pytest.approx(-(1.2 - 0.8 + 1.1 + 0.5) / 4, rel=1e-6)
    assert float(m["pg_clipfrac"]) == pytest.approx(2 / 4)
    assert float(m["pg_clipfrac_high"]) == pytest.approx(1 / 4)
    assert float(m["pg_clipfrac_low"]) == pytest.approx(1 / 4)
    k3 = [(1 / r) - 1 + math.log(r) for r in (1.5, 0.5, 1.1, 0.5)]
    assert float(m["approx_kl"]) == pytest.approx(sum(k3) / 4, rel=1e-5)


def test_asymmetric_clip_range():
    behaviour = jnp.zeros((1, 1))
    lp = jnp.log(jnp.array([[1.25]]))
    loss_tight, _ = grpo_clip_loss(lp, behaviour, jnp.array([1.0]), jnp.ones((1, 1), bool), eps_low=0.2, eps_high=0.2)
    loss_wide, _ = grpo_clip_loss(lp, behaviour, jnp.array([1.0]), jnp.ones((1, 1), bool), eps_low=0.2, eps_high=0.28)
    assert float(loss_tight) == pytest.approx(-1.2)
    assert float(loss_wide) == pytest.approx(-1.25)


def test_clipped_tokens_have_no_gradient():
    import jax

    behaviour = jnp.zeros((2, 1))
    adv = jnp.array([1.0, 1.0])
    mask = jnp.ones((2, 1), bool)

    def f(lp):
        return grpo_clip_loss(lp, behaviour, adv, mask, eps_low=0.2, eps_high=0.2)[0]

    grad = jax.grad(f)(jnp.log(jnp.array([[1.5], [1.0]])))
    assert float(grad[0, 0]) == 0.0  # ratio 1.5 with A > 0 is clipped
    assert float(grad[1, 0]) == pytest.approx(-0.5)  # d(-ratio*A/2)/dlp at ratio 1


def test_kl_penalty_zero_at_reference_and_positive_elsewhere():
    lp = jnp.log(jnp.array([[0.5, 0.2]]))
    mask = jnp.ones((1, 2), bool)
    assert float(kl_penalty(lp, lp, mask)) == pytest.approx(0.0, abs=1e-7)
    assert float(kl_penalty(lp, lp + 0.3, mask)) > 0
