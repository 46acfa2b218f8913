"""The jitted GRPO update on real rollouts from the real sampler."""

import jax
import numpy as np
import pytest

from jaxreplay.config import load_config
from jaxreplay.learn.learner import make_optimizer, make_train_step
from jaxreplay.models.transformer import forward, init_params
from jaxreplay.rollout.rollouts import to_device_batch
from jaxreplay.rollout.sampling import make_sampler, policy_logprobs
from jaxreplay.tasks.registry import make_task

SMALL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
         "model.d_ff=64", "task.max_digits=2"]


def rollout_batch(config, advantage):
    task = make_task(config.task)
    graphdef, params = init_params(config.model, 0)
    s = config.sampling
    sample = make_sampler(graphdef, config.model, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                          top_k=s.top_k, top_p=s.top_p, stop_ids=task.tokenizer.eos_ids, pad_id=task.tokenizer.pad_id)
    prompts, mask = task.encode_prompts(task.train_problems(0, 0, 8))
    r = jax.device_get(sample(params, prompts, mask, jax.random.PRNGKey(1)))
    batch = {"tokens": r.tokens, "attention_mask": r.attention_mask, "completion_mask": r.completion_mask,
             "logprobs": r.logprobs, "advantage": np.full(8, advantage, np.float32)}
    return graphdef, params, to_device_batch(batch)


@pytest.mark.tier
@pytest.mark.parametrize("sampling", [[], ["sampling.temperature=0.7", "sampling.top_k=5", "sampling.top_p=0.9"]])
def test_fresh_rollouts_have_ratio_one(sampling):
    """The learner scores exactly the distribution the sampler drew from: no drift, no clipping."""
    config = load_config(None, SMALL + sampling)
    graphdef, params, batch = rollout_batch(config, advantage=1.0)
    optimizer = make_optimizer(config.train)
    step = make_train_step(graphdef, config, optimizer)
    _, _, m = step(params, optimizer.init(params), batch, None)
    assert float(m["ratio_mean"]) == pytest.approx(1.0, abs=1e-5)
    assert float(m["approx_kl"]) == pytest.approx(0.0, abs=1e-5)
    assert float(m["pg_clipfrac"]) == 0.0
    assert np.isfinite(float(m["grad_norm"])) and float(m["grad_norm"]) > 0


def numpy_entropy_metric(logits, completion_mask, temperature, top_k):
    """The token mean over completion tokens of the entropy of softmax(logits[t-1] / T),
    restricted to its top_k largest entries and renormalised (0: all), by hand."""
    z = np.asarray(logits, np.float64)[:, :-1] / temperature
    if top_k:
        kth = np.sort(z, axis=-1)[..., -top_k][..., None]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ent = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)
    mask = np.asarray(completion_mask)[:, 1:]
    return float((ent * mask).sum() / mask.sum())


@pytest.mark.parametrize("top_k, temperature", [(0, 1.0), (0, 0.7), (2, 1.0), (2, 0.7)])
def test_the_entropy_metric_is_that_of_the_distribution_the_actor_samples_from(top_k, temperature):
    """Under top-k the actor draws from the renormalised top-k distribution at the sampling
    temperature: the reported entropy is that one's (at most log k), not the full softmax's."""
    config = load_config(None, SMALL + [f"sampling.top_k={top_k}", f"sampling.temperature={temperature}"])
    graphdef, params, batch = rollout_batch(config, advantage=1.0)
    logits = forward(graphdef, params, batch["tokens"], batch["attention_mask"])
    want = numpy_entropy_metric(logits, batch["completion_mask"], temperature, top_k)
    optimizer = make_optimizer(config.train)
    _, _, m = make_train_step(graphdef, config, optimizer)(params, optimizer.init(params), batch, None)
    assert float(m["entropy"]) == pytest.approx(want, abs=1e-5)
    if top_k:
        assert float(m["entropy"]) <= np.log(top_k) + 1e-6
        assert numpy_entropy_metric(logits, batch["completion_mask"], temperature, 0) > want + 0.1


@pytest.mark.tier
@pytest.mark.parametrize("advantage, direction", [(1.0, 1), (-1.0, -1)])
def test_update_moves_sampled_tokens_with_the_sign_of_the_advantage(advantage, direction):
    config = load_config(None, SMALL + ["train.learning_rate=1e-3"])
    graphdef, params, batch = rollout_batch(config, advantage)
    before = jax.tree.map(np.asarray, params)
    optimizer = make_optimizer(config.train)
    step = make_train_step(graphdef, config, optimizer)
    new_params, opt_state = params, optimizer.init(params)
    for _ in range(3):
        new_params, opt_state, _ = step(new_params, opt_state, batch, None)

    def mean_logprob(p):
        logits = forward(graphdef, p, batch["tokens"], batch["attention_mask"])
        lp = policy_logprobs(logits, batch["tokens"], temperature=1.0)
        return float((lp * batch["completion_mask"]).sum() / batch["completion_mask"].sum())

    assert direction * (mean_logprob(new_params) - mean_logprob(before)) > 1e-3


def test_kl_penalty_to_reference_is_reported_and_zero_at_the_reference():
    config = load_config(None, SMALL + ["train.kl_coef=0.1"])
    graphdef, params, batch = rollout_batch(config, advantage=0.0)
    optimizer = make_optimizer(config.train)
    step = make_train_step(graphdef, config, optimizer)
    reference = jax.tree.map(np.array, params)
    _, _, m = step(params, optimizer.init(params), batch, reference)
    assert float(m["kl_ref"]) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("loss", [["train.loss=tis"], ["train.loss=asymre", "train.advantage=group_centered",
                                                       "train.asymre_delta_v=0"],
                                  ["train.loss_aggregation=constant"], ["train.loss_aggregation=sequence_mean"],
                                  ["train.loss=grpo_tis"], ["train.loss=seq_mask"], ["train.loss=m2po"],
                                  ["train.loss=decoupled"]])
def test_every_loss_by_name_raises_the_likelihood_of_positive_advantage_rollouts(loss):
    config = load_config(None, SMALL + ["train.learning_rate=1e-3", *loss])
    graphdef, params, batch = rollout_batch(config, 1.0)
    optimizer = make_optimizer(config.train)
    step = make_train_step(graphdef, config, optimizer)
    new_params, opt_state = params, optimizer.init(params)

    def mean_logprob(p):
        lp = policy_logprobs(forward(graphdef, p, batch["tokens"], batch["attention_mask"]), batch["tokens"],
                             temperature=1.0)
        return float((lp * batch["completion_mask"]).sum() / batch["completion_mask"].sum())

    before = mean_logprob(params)
    for _ in range(3):
        new_params, opt_state, m = step(new_params, opt_state, batch, None)
    assert np.isfinite(float(m["loss"]))
    assert mean_logprob(new_params) - before > 1e-3


@pytest.mark.parametrize("warmup, expected", [(4, [0.0, 0.25e-3, 0.5e-3, 0.75e-3, 1e-3, 1e-3]), (0, [1e-3] * 6)])
def test_each_update_reports_the_learning_rate_it_applied(warmup, expected):
    """The linear warm-up shows in the metrics: update k of a fresh optimizer uses lr * k / warmup."""
    config = load_config(None, SMALL + ["train.learning_rate=1e-3", f"train.warmup_steps={warmup}"])
    graphdef, params, batch = rollout_batch(config, advantage=1.0)
    optimizer = make_optimizer(config.train)
    step = make_train_step(graphdef, config, optimizer)
    opt_state, rates = optimizer.init(params), []
    for _ in expected:
        params, opt_state, m = step(params, opt_state, batch, None)
        rates.append(float(m["learning_rate"]))
    np.testing.assert_allclose(rates, expected, rtol=1e-6)
