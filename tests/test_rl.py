"""Advantage and loss maths on small hand-checked examples."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.learn.losses import grpo_clip_loss, kl_penalty, masked_mean
from jaxreplay.rollout.advantages import group_normalized


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
    k3 = [r - 1 - math.log(r) for r in (1.5, 0.5, 1.1, 0.5)]
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


# --- advantage estimators and the other losses, by name ------------------------------

from jaxreplay.learn.losses import LOSSES, asymre_loss, make_aggregate, truncated_is_loss
from jaxreplay.rollout.advantages import ADVANTAGES, group_centered, leave_one_out


def test_group_centered_subtracts_the_mean_only():
    np.testing.assert_allclose(group_centered(np.array([[1.0, 0.0, 0.0, 0.0]])), [[0.75, -0.25, -0.25, -0.25]])


def test_leave_one_out_baseline_excludes_the_rollout_itself():
    # r = 1,0,0,0: baseline of the first is mean(0,0,0)=0; of the others mean(1,0,0)=1/3.
    np.testing.assert_allclose(leave_one_out(np.array([[1.0, 0.0, 0.0, 0.0]])), [[1, -1 / 3, -1 / 3, -1 / 3]],
                               rtol=1e-6)
    # LOO = G/(G-1) x group-centred.
    r = np.random.default_rng(0).random((3, 5))
    np.testing.assert_allclose(leave_one_out(r), 5 / 4 * group_centered(r), rtol=1e-5)


def test_estimators_are_registered_by_their_config_names():
    assert set(ADVANTAGES) == {"group_normalized", "group_centered", "leave_one_out"}
    assert set(LOSSES) == {"grpo", "tis", "asymre", "grpo_tis", "seq_mask", "m2po", "decoupled"}


def test_truncated_is_caps_the_weight_and_keeps_the_gradient():
    # ratios 3 (capped at 2) and 0.5; advantages +1, -1; one token each.
    behaviour = jnp.zeros((2, 1))
    lp = jnp.log(jnp.array([[3.0], [0.5]]))
    adv, mask = jnp.array([1.0, -1.0]), jnp.ones((2, 1), bool)
    loss, m = truncated_is_loss(lp, behaviour, adv, mask, tis_cap=2.0)
    assert float(loss) == pytest.approx(-(2.0 * 1 + 0.5 * -1) / 2, rel=1e-6)
    assert float(m["tis_truncfrac"]) == pytest.approx(0.5)
    # d loss / d logprob = -min(ratio, cap) * A / 2: the capped token still learns (PPO's would not).
    grad = jax.grad(lambda x: truncated_is_loss(x, behaviour, adv, mask, tis_cap=2.0)[0])(lp)
    np.testing.assert_allclose(grad, [[-1.0], [0.25]], rtol=1e-6)


def test_asymre_is_reinforce_on_shifted_advantages_with_no_ratio():
    # Far off-policy (behaviour log-probs irrelevant): gradient = -(A - dV) / n_tokens per token.
    lp = jnp.log(jnp.array([[0.5, 0.5], [0.25, 0.5]]))
    behaviour = jnp.full((2, 2), -9.0)
    adv, mask = jnp.array([0.5, -0.5]), jnp.array([[True, True], [True, False]])
    loss, _ = asymre_loss(lp, behaviour, adv, mask, asymre_delta_v=-0.1)
    expected = -(0.6 * math.log(0.5) * 2 + -0.4 * math.log(0.25)) / 3
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    grad = jax.grad(lambda x: asymre_loss(x, behaviour, adv, mask, asymre_delta_v=-0.1)[0])(lp)
    np.testing.assert_allclose(grad, [[-0.2, -0.2], [0.4 / 3, 0.0]], rtol=1e-5, atol=1e-7)


def test_aggregations_weigh_tokens_as_dapo_grpo_and_dr_grpo():
    # Per-token values: sequence 1 has 3 tokens of 1, sequence 2 has 1 token of 4.
    x = jnp.array([[1.0, 1.0, 1.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = jnp.array([[True, True, True, False], [True, False, False, False]])
    assert float(make_aggregate("token_mean", 4)(x, mask)) == pytest.approx(7 / 4)  # DAPO: all tokens equal
    assert float(make_aggregate("sequence_mean", 4)(x, mask)) == pytest.approx((1 + 4) / 2)  # GRPO
    assert float(make_aggregate("constant", 5)(x, mask)) == pytest.approx(7 / (2 * 5))  # Dr.GRPO: / B*L


def test_grpo_loss_uses_the_given_aggregation():
    lp = jnp.zeros((2, 2))
    mask = jnp.array([[True, True], [True, False]])
    loss, _ = grpo_clip_loss(lp, lp, jnp.array([1.0, 4.0]), mask, eps_low=0.2, eps_high=0.2,
                             aggregate=make_aggregate("sequence_mean", 2))
    assert float(loss) == pytest.approx(-(1 + 4) / 2)


def test_loss_and_advantage_are_chosen_by_name_in_config():
    from jaxreplay.config import ConfigError, load_config

    c = load_config(None, ["train.loss=asymre", "train.advantage=leave_one_out", "train.loss_aggregation=constant"])
    assert (c.train.loss, c.train.advantage, c.train.asymre_delta_v) == ("asymre", "leave_one_out", -0.1)
    assert load_config(None).train.loss == "grpo"  # the paper's clipped GRPO stays the default
    with pytest.raises(ConfigError, match="train.advantage"):
        load_config(None, ["train.loss=asymre"])  # r - V needs a centred estimator
    with pytest.raises(ConfigError, match="train.loss"):
        load_config(None, ["train.loss=ppo2"])


def _categorical_pair():
    """Two distributions over 6 tokens, and many tokens drawn from each."""
    behaviour = jax.nn.log_softmax(jnp.array([1.0, 0.2, -0.5, 2.0, 0.0, -1.0]))
    current = jax.nn.log_softmax(jnp.array([0.3, 0.9, -0.2, 1.2, 0.6, -0.4]))
    return behaviour, current


def _kl(p, q):
    return float(jnp.sum(jnp.exp(p) * (p - q)))


def test_approx_kl_estimates_kl_behaviour_to_current_on_behaviour_samples():
    behaviour, current = _categorical_pair()
    tokens = jax.random.categorical(jax.random.key(0), behaviour, shape=(200_000,))
    lp, blp = current[tokens][None], behaviour[tokens][None]
    _, m = grpo_clip_loss(lp, blp, jnp.zeros(1), jnp.ones_like(lp, bool), eps_low=0.2, eps_high=0.2)
    assert float(m["approx_kl"]) == pytest.approx(_kl(behaviour, current), rel=0.03)
    assert abs(_kl(current, behaviour) - _kl(behaviour, current)) > 0.1 * _kl(behaviour, current)  # directions differ


def test_kl_penalty_estimates_kl_current_to_reference_on_current_samples():
    reference, current = _categorical_pair()
    tokens = jax.random.categorical(jax.random.key(1), current, shape=(200_000,))
    value = kl_penalty(current[tokens][None], reference[tokens][None], jnp.ones((1, tokens.size), bool))
    assert float(value) == pytest.approx(_kl(current, reference), rel=0.03)


def test_kl_penalty_gradient_in_expectation_is_that_of_kl_reference_to_current():
    """Enumerated over a 6-token vocabulary, exactly: the k3 penalty's gradient with respect
    to the current logits, averaged over tokens drawn from the current policy (the samples
    carry no gradient), is the gradient of KL(reference || current), not of KL(current ||
    reference), whose value it estimates. Its docstring says both."""
    reference, _ = _categorical_pair()
    logits = jnp.array([0.3, 0.9, -0.2, 1.2, 0.6, -0.4])
    one = jnp.ones((1, 1), bool)

    def penalty(z, token):  # the penalty of one sampled token
        return kl_penalty(jax.nn.log_softmax(z)[token][None, None], reference[token][None, None], one)

    per_token = jax.vmap(jax.grad(penalty), in_axes=(None, 0))(logits, jnp.arange(6))
    expected = jnp.sum(jax.nn.softmax(logits)[:, None] * per_token, axis=0)
    reverse = jax.grad(lambda z: jnp.sum(jnp.exp(reference) * (reference - jax.nn.log_softmax(z))))(logits)
    forward = jax.grad(lambda z: jnp.sum(jax.nn.softmax(z) * (jax.nn.log_softmax(z) - reference)))(logits)
    np.testing.assert_allclose(expected, reverse, atol=1e-6)
    assert float(jnp.max(jnp.abs(expected - forward))) > 0.02
    doc = " ".join(kl_penalty.__doc__.split())
    assert "gradient" in doc and "KL(reference || current)" in doc.split("gradient", 1)[1]


def test_asymre_reports_no_loss_for_tokens_at_the_filter_floor():
    from jaxreplay.rollout.sampling import LOGPROB_FLOOR

    lp = jnp.array([[-0.5, LOGPROB_FLOOR, -1.0]])
    mask = jnp.ones((1, 3), bool)
    loss, _ = asymre_loss(lp, lp, jnp.array([0.5]), mask, asymre_delta_v=-0.1)
    assert float(loss) == pytest.approx(0.6 * (0.5 + 1.0) / 3, rel=1e-6)  # the floored token adds 0
    grad = jax.grad(lambda x: asymre_loss(x, lp, jnp.array([0.5]), mask, asymre_delta_v=-0.1)[0])(lp)
    assert float(grad[0, 1]) == 0.0 and float(grad[0, 0]) == pytest.approx(-0.6 / 3)
