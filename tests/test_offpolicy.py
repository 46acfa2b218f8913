"""Off-policy corrections (learn/losses.py) and the staleness statistics by age (learn/staleness.py),
each against a hand computation in numpy on a small batch, and the masks by their gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.config import ConfigError, load_config
from jaxreplay.learn import staleness
from jaxreplay.learn.losses import (decoupled_loss, grpo_tis_loss, m2po_keep, m2po_loss, sequence_mask_loss,
                                    truncated_is_loss)

# Three rows of four tokens; row 2's last token is padding. Ratios π_θ/π_behaviour chosen by hand.
RATIO = np.array([[1.0, 1.5, 0.5, 1.1], [2.5, 0.7, 1.0, 0.9], [1.3, 0.6, 1.0, 9.0]], np.float32)
MASK = np.array([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]], bool)
ADV = np.array([1.0, -1.0, 0.5], np.float32)
BEHAVIOUR = np.log(np.full((3, 4), 0.25, np.float32))
LOGPROBS = BEHAVIOUR + np.log(RATIO)
EPS = 0.2


def token_mean(x):
    return float(np.sum(np.where(MASK, x, 0.0)) / MASK.sum())


def ppo(ratio, adv):
    return np.minimum(ratio * adv[:, None], np.clip(ratio, 1 - EPS, 1 + EPS) * adv[:, None])


def grad_of(loss, **kw):
    return np.asarray(jax.grad(lambda lp: loss(lp, jnp.asarray(BEHAVIOUR), jnp.asarray(ADV), jnp.asarray(MASK),
                                               **kw)[0])(jnp.asarray(LOGPROBS)))


def test_grpo_tis_weighs_the_clipped_objective_by_the_truncated_behaviour_ratio():
    # The proximal policy two updates back: π_prox/π_behaviour = 2 everywhere (capped at 1.5), r = RATIO / 2.
    proximal = BEHAVIOUR + np.log(2.0)
    loss, m = grpo_tis_loss(jnp.asarray(LOGPROBS), jnp.asarray(BEHAVIOUR), jnp.asarray(ADV), jnp.asarray(MASK),
                            eps_low=EPS, eps_high=EPS, tis_cap=1.5, proximal_logprobs=jnp.asarray(proximal))
    assert float(loss) == pytest.approx(-token_mean(1.5 * ppo(RATIO / 2, ADV)), rel=1e-5)
    assert float(m["tis_truncfrac"]) == 1.0 and float(m["is_weight_mean"]) == pytest.approx(1.5)


def test_grpo_tis_with_one_update_per_batch_is_truncated_is_in_value_and_gradient():
    args = (jnp.asarray(LOGPROBS), jnp.asarray(BEHAVIOUR), jnp.asarray(ADV), jnp.asarray(MASK))
    assert float(grpo_tis_loss(*args, eps_low=EPS, eps_high=EPS, tis_cap=2.0)[0]) == \
        pytest.approx(float(truncated_is_loss(*args, tis_cap=2.0)[0]), rel=1e-6)
    np.testing.assert_allclose(grad_of(grpo_tis_loss, eps_low=EPS, eps_high=EPS, tis_cap=2.0),
                               grad_of(truncated_is_loss, tis_cap=2.0), rtol=1e-6)


def test_sequence_mask_drops_rows_whose_geometric_mean_ratio_leaves_the_interval():
    geometric = np.exp(np.sum(np.where(MASK, np.log(RATIO), 0), 1) / MASK.sum(1))  # 0.97, 1.16, 0.92
    keep = (geometric >= 0.95) & (geometric <= 1.1)  # row 0 only
    assert keep.tolist() == [True, False, False]
    kw = dict(eps_low=EPS, eps_high=EPS, seq_mask_low=0.95, seq_mask_high=1.1)
    loss, m = sequence_mask_loss(jnp.asarray(LOGPROBS), jnp.asarray(BEHAVIOUR), jnp.asarray(ADV), jnp.asarray(MASK),
                                 **kw)
    assert float(loss) == pytest.approx(-token_mean(np.where(keep[:, None], ppo(RATIO, ADV), 0)), rel=1e-5)
    assert float(m["seq_mask_frac"]) == pytest.approx(7 / 11)
    grad = grad_of(sequence_mask_loss, **kw)
    assert np.all(grad[1:] == 0) and np.any(grad[0] != 0)  # the dropped rows get no gradient


def m2po_by_hand(threshold):
    """Drop the largest squared log-ratio one at a time until the rest's mean is under the threshold."""
    squared = {(i, j): np.log(RATIO[i, j]) ** 2 for i in range(3) for j in range(4) if MASK[i, j]}
    kept = dict(squared)
    while kept and np.mean(list(kept.values())) > threshold:
        del kept[max(kept, key=kept.get)]
    return np.array([[(i, j) in kept for j in range(4)] for i in range(3)])


def test_m2po_masks_the_largest_squared_log_ratios_until_the_second_moment_is_under_the_threshold():
    for threshold in (0.04, 0.2, 10.0):
        keep = np.asarray(m2po_keep(jnp.asarray(np.log(RATIO)), jnp.asarray(MASK), threshold))
        np.testing.assert_array_equal(keep, m2po_by_hand(threshold))
    keep = m2po_by_hand(0.04)
    assert 0 < keep.sum() < MASK.sum()
    loss, m = m2po_loss(jnp.asarray(LOGPROBS), jnp.asarray(BEHAVIOUR), jnp.asarray(ADV), jnp.asarray(MASK),
                        m2po_threshold=0.04)
    assert float(loss) == pytest.approx(-token_mean(np.where(keep, RATIO * ADV[:, None], 0)), rel=1e-5)
    assert float(m["m2po_masked_frac"]) == pytest.approx(1 - keep.sum() / MASK.sum())
    assert float(m["m2po_m2"]) == pytest.approx(token_mean(np.log(RATIO) ** 2), rel=1e-5)
    grad = grad_of(m2po_loss, m2po_threshold=0.04)
    assert np.all(grad[~keep] == 0) and np.all(grad[keep & (ADV[:, None] != 0)] != 0)


def test_decoupled_weighs_by_the_proximal_behaviour_ratio_and_drops_tokens_past_the_cap():
    # One update per batch (proximal = current): r = 1, gradient = weight · A · ∇log π / n on kept tokens.
    loss, m = decoupled_loss(jnp.asarray(LOGPROBS), jnp.asarray(BEHAVIOUR), jnp.asarray(ADV), jnp.asarray(MASK),
                             eps_low=EPS, eps_high=EPS, decoupled_weight_cap=2.0)
    keep = MASK & (RATIO <= 2.0)  # 2.5 goes; 9.0 is padding
    assert float(loss) == pytest.approx(-token_mean(np.where(keep, RATIO * ADV[:, None], 0)), rel=1e-5)
    assert float(m["decoupled_masked_frac"]) == pytest.approx(1 / 11)
    grad = grad_of(decoupled_loss, eps_low=EPS, eps_high=EPS, decoupled_weight_cap=2.0)
    np.testing.assert_allclose(grad, np.where(keep, -RATIO * ADV[:, None] / MASK.sum(), 0), rtol=1e-5)
    # A proximal policy between: the clip acts on r = π_θ/π_prox.
    proximal = BEHAVIOUR + np.log(1.2)
    loss, _ = decoupled_loss(jnp.asarray(LOGPROBS), jnp.asarray(BEHAVIOUR), jnp.asarray(ADV), jnp.asarray(MASK),
                             eps_low=EPS, eps_high=EPS, decoupled_weight_cap=2.0,
                             proximal_logprobs=jnp.asarray(proximal))
    assert float(loss) == pytest.approx(-token_mean(1.2 * ppo(RATIO / 1.2, ADV)), rel=1e-5)


@pytest.mark.parametrize("override, key", [
    ("train.tis_cap=1.0", "train.tis_cap"), ("train.decoupled_weight_cap=0.5", "train.decoupled_weight_cap"),
    ("train.m2po_threshold=0", "train.m2po_threshold"), ("train.seq_mask_low=1.3", "train.seq_mask_high")])
def test_settings_that_cannot_work_are_one_line_config_errors(override, key):
    with pytest.raises(ConfigError, match=key) as e:
        load_config(None, [override])
    assert "\n" not in str(e.value)


def test_a_bad_correction_setting_exits_2(capsys):
    from jaxreplay.cli import main
    assert main(["config", "configs/demo.yaml", "train.loss=seq_mask", "train.seq_mask_low=2",
                 "train.seq_mask_high=1"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


# --- staleness by age --------------------------------------------------------------------------

def test_a_buckets_clip_fraction_is_the_hand_count_and_empty_buckets_are_left_out():
    rng = np.random.default_rng(0)
    rows, t = 12, 6
    age = np.array([0, 0, 1, 2, 3, 3, 0, 9, 9, 9, 20, 40], np.int32)  # no row is 4-7 versions old
    ratio = np.exp(rng.normal(0, 0.3, (rows, t))).astype(np.float32)
    mask = rng.random((rows, t)) < 0.8
    adv = rng.choice([-1.0, 1.0], rows).astype(np.float32)
    behaviour = np.log(rng.uniform(0.1, 0.9, (rows, t))).astype(np.float32)
    stats = jax.jit(lambda *a: staleness.by_age(*a, eps_low=EPS, eps_high=0.28))(
        behaviour + np.log(ratio), behaviour, adv, mask, age)
    record = staleness.records(jax.device_get(stats))
    buckets = {"0": [0, 1, 6], "1": [2], "2-3": [3, 4, 5], "8-15": [7, 8, 9], "16+": [10, 11]}
    assert {k.split("/")[1] for k in record} == set(buckets)  # 4-7 has no row: no key at all
    for bucket, members in buckets.items():
        r, m, a = ratio[members], mask[members], adv[members][:, None]
        tokens = r[m]
        assert record[f"by_age/{bucket}/rows"] == len(members)
        low = np.sum(m & (r < 1 - EPS) & (a < 0)) / m.sum()
        high = np.sum(m & (r > 1.28) & (a > 0)) / m.sum()
        assert record[f"by_age/{bucket}/clipfrac_low"] == pytest.approx(low)
        assert record[f"by_age/{bucket}/clipfrac_high"] == pytest.approx(high)
        assert record[f"by_age/{bucket}/ratio_mean"] == pytest.approx(tokens.mean(), rel=1e-5)
        assert record[f"by_age/{bucket}/ratio_p99"] == pytest.approx(np.quantile(tokens, 0.99), rel=1e-5)
        assert record[f"by_age/{bucket}/kl_k3"] == pytest.approx(np.mean(tokens - 1 - np.log(tokens)), rel=1e-4)
        assert record[f"by_age/{bucket}/ess_frac"] == pytest.approx(
            tokens.sum() ** 2 / np.sum(tokens ** 2) / tokens.size, rel=1e-5)
    assert sum(record[f"by_age/{b}/clipfrac_low"] > 0 for b in buckets) >= 2  # the counts are not all trivial


@pytest.mark.tier
@pytest.mark.parametrize("loss", ["grpo", "m2po"])
def test_the_train_step_reports_by_age_from_its_own_forward_pass_with_or_without_micro_batches(loss):
    """The step's by-age statistics are `by_age` of the log-probs the loss scored (fresh rows: ratio 1), the
    same when the batch goes through the model two rows at a time; a batch without ages gets none."""
    from test_learner import SMALL, rollout_batch

    from jaxreplay.learn.learner import make_optimizer, make_train_step
    results = []
    for micro in (0, 2):
        config = load_config(None, SMALL + [f"train.loss={loss}", f"train.micro_batch_size={micro}",
                                            "train.batch_size=8"])
        graphdef, params, batch = rollout_batch(config, advantage=1.0)
        optimizer = make_optimizer(config.train)
        step = make_train_step(graphdef, config, optimizer)
        aged = {**batch, "age": jnp.array([0, 0, 1, 1, 1, 3, 3, 17], jnp.int32)}
        _, _, unaged = step(jax.tree.map(jnp.copy, params), optimizer.init(params), batch, None)
        assert staleness.KEY not in unaged
        _, _, m = step(params, optimizer.init(params), aged, None)
        results.append(staleness.records(jax.device_get(m[staleness.KEY])))
    assert results[0].keys() == {staleness.key(b, s) for b in ("0", "1", "2-3", "16+") for s in staleness.STATS}
    for k, v in results[0].items():
        assert results[1][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert results[0]["by_age/1/rows"] == 3 and results[0]["by_age/16+/ratio_p99"] == pytest.approx(1.0, abs=1e-5)
    assert results[0]["by_age/0/ess_frac"] == pytest.approx(1.0, abs=1e-5)


def test_the_report_plots_each_arms_clip_fraction_and_kl_against_age(tmp_path):
    from jaxreplay.research import report_age
    from jaxreplay.research.report_data import READ_KEYS, RunData, Setting, trimmed_metrics

    def step(n, rows):
        return {"step": n, **{staleness.key(b, s): v for b, (r, lo, hi, k) in rows.items()
                              for s, v in zip(("rows", "clipfrac_low", "clipfrac_high", "kl_k3"), (r, lo, hi, k))}}

    # Bucket 1 has 3 rows at step 1 and 1 row at step 2: weighed 3:1. Bucket 2-3 appears once.
    records = [{"step": 0}, step(1, {"0": (4, 0.0, 0.1, 1e-3), "1": (3, 0.2, 0.2, 0.01)}),
               step(2, {"0": (6, 0.0, 0.0, 1e-3), "1": (1, 0.6, 0.2, 0.05), "2-3": (1, 0.5, 0.5, 0.3)})]
    run = RunData(dir=None, config={}, records=records)
    clip = report_age.run_profile(run, ("clipfrac_low", "clipfrac_high"))
    assert clip.keys() == {"0", "1", "2-3"}
    assert clip["1"] == pytest.approx((3 * 0.4 + 1 * 0.8) / 4) and clip["0"] == pytest.approx(0.4 / 10)
    assert all(k in READ_KEYS for r in records for k in r)  # a trimmed run keeps what the figures read
    assert trimmed_metrics(records).count("by_age/1/kl_k3") == 2
    written = report_age.write([Setting("replay", [run])], tmp_path, "p_")
    assert [p.name for p, _ in written] == ["p_age_clipfrac.png", "p_age_kl.png"]
    assert all(p.stat().st_size > 0 for p, _ in written)
    assert report_age.write([Setting("old", [RunData(dir=None, config={}, records=[{"step": 1}])])], tmp_path) == []
