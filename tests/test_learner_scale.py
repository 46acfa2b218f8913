"""A learner that scales in memory computes what the plain one does.

Chunked log-probs and entropy equal the full-logits ones; micro-batched (gradient
accumulation), rematerialised and chunked steps give the plain step's loss, metrics and
gradients, for every loss aggregation; bfloat16 Adam moments are what the option says.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.config import ConfigError, load_config
from jaxreplay.learn.learner import make_loss_and_grad, make_optimizer, make_train_step
from jaxreplay.learn.scoring import sampling_entropy, sequence_scores
from jaxreplay.models.transformer import forward, init_params, score_hidden
from jaxreplay.rollout.sampling import policy_logprobs

SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
         "model.d_ff=64", "model.vocab_size=40", "model.max_seq_len=24", "train.batch_size=8",
         "train.prompts_per_step=1", "sampling.max_new_tokens=9"]
ROWS, LENGTH, PROMPT = 8, 16, 7


def synthetic_batch(seed: int = 0) -> dict:
    """Left-padded prompts, completions of different lengths (one empty), behaviour log-probs
    near the current ones and mixed-sign advantages: every aggregation weighs rows differently."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 40, (ROWS, LENGTH)).astype(np.int32)
    attention = np.ones((ROWS, LENGTH), bool)
    attention[:, :2] = rng.random((ROWS, 2)) < 0.5  # some left padding
    completion = np.zeros((ROWS, LENGTH), bool)
    for r, n in enumerate([9, 1, 4, 0, 6, 9, 2, 5]):
        completion[r, PROMPT:PROMPT + n] = True
        attention[r, PROMPT + n:] = False
    return {"tokens": jnp.asarray(tokens), "attention_mask": jnp.asarray(attention),
            "completion_mask": jnp.asarray(completion),
            "logprobs": jnp.asarray(np.where(completion, -3.7 + 0.3 * rng.standard_normal((ROWS, LENGTH)), 0.0),
                                    jnp.float32),
            "advantage": jnp.asarray(rng.standard_normal(ROWS), jnp.float32)}


@pytest.fixture(scope="module")
def model():
    config = load_config(None, SMALL)
    graphdef, params = init_params(config.model, 3)
    return graphdef, params


@pytest.mark.parametrize("chunk", [1, 4, 6, 15, 100])
@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)])
def test_chunked_logprobs_and_entropy_equal_the_full_logits_ones(model, chunk, sampling):
    """Chunk sizes that divide the 15 scored positions, do not, are 1, and exceed them."""
    graphdef, params = model
    b = synthetic_batch()
    logits = forward(graphdef, params, b["tokens"], b["attention_mask"])
    want_lp = policy_logprobs(logits, b["tokens"], **sampling)
    want_ent = jnp.pad(sampling_entropy(logits[:, :-1], **sampling), ((0, 0), (1, 0)))

    @jax.jit
    def chunked(params):
        h, unembed = score_hidden(graphdef, params, b["tokens"], b["attention_mask"])
        return sequence_scores(h, b["tokens"], unembed, chunk=chunk, **sampling)

    lp, ent = chunked(params)
    assert lp.shape == ent.shape == (ROWS, LENGTH)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(want_lp), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), np.asarray(want_ent), rtol=0, atol=1e-5)


def test_a_chunked_gradient_never_holds_the_whole_logits_array():
    """The compiled program of a chunked gradient has no [B, T or T-1, V] float32 buffer; the plain one has."""
    graphdef, params = init_params(load_config(None, SMALL + ["model.vocab_size=4000"]).model, 0)
    b = synthetic_batch()
    whole = re.compile(rf"f32\[{ROWS},(?:{LENGTH}|{LENGTH - 1}),4000\]")
    texts = {}
    for chunk in (0, 3):
        c = load_config(None, SMALL + ["model.vocab_size=4000", f"train.logits_chunk_size={chunk}"])
        fn = jax.jit(make_loss_and_grad(graphdef, c))
        texts[chunk] = fn.lower(params, b, None).compile().as_text()
    assert whole.search(texts[0]) and not whole.search(texts[3])


def grads_under(graphdef, params, overrides, batch, ref=None):
    config = load_config(None, SMALL + overrides)
    loss, metrics, grads = jax.jit(make_loss_and_grad(graphdef, config))(params, batch, ref)
    return float(loss), jax.device_get(metrics), jax.device_get(grads)


def assert_same(a, b, rtol=2e-5, atol=1e-6):
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = a, b
    assert loss_a == pytest.approx(loss_b, rel=rtol, abs=atol)
    assert set(metrics_a) == set(metrics_b)
    for k in metrics_a:
        assert float(metrics_a[k]) == pytest.approx(float(metrics_b[k]), rel=rtol, abs=atol), k
    for x, y in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
@pytest.mark.parametrize("micro", [1, 2, 4])
def test_micro_batches_give_the_whole_batch_loss_metrics_and_gradient(model, aggregation, micro):
    """Rows with 0..9 completion tokens: a per-micro-batch normaliser would weigh them wrongly."""
    graphdef, params = model
    batch = synthetic_batch(1)
    agg = [f"train.loss_aggregation={aggregation}"]
    plain = grads_under(graphdef, params, agg, batch)
    assert abs(plain[0]) > 1e-4 and max(float(jnp.abs(g).max()) for g in jax.tree.leaves(plain[2])) > 1e-4
    assert_same(grads_under(graphdef, params, agg + [f"train.micro_batch_size={micro}"], batch), plain)


@pytest.mark.parametrize("loss", [["train.loss=tis"], ["train.loss=asymre", "train.advantage=group_centered"],
                                  ["train.kl_coef=0.3"], ["sampling.top_k=7", "sampling.temperature=0.8"]])
def test_micro_batches_are_exact_for_every_loss_and_the_kl_penalty(model, loss):
    graphdef, params = model
    batch = synthetic_batch(2)
    ref = jax.tree.map(lambda x: x * 0.9, params)  # a reference that differs: KL > 0
    plain = grads_under(graphdef, params, loss, batch, ref)
    assert_same(grads_under(graphdef, params, loss + ["train.micro_batch_size=2"], batch, ref), plain)


@pytest.mark.parametrize("memory", [["train.remat=full"], ["train.remat=dots"], ["train.logits_chunk_size=4"],
                                    ["train.remat=dots", "train.logits_chunk_size=5", "train.micro_batch_size=4"]])
def test_rematerialised_and_chunked_steps_give_the_plain_gradient(model, memory):
    graphdef, params = model
    batch = synthetic_batch(3)
    plain = grads_under(graphdef, params, [], batch)
    assert_same(grads_under(graphdef, params, memory, batch), plain)


@pytest.mark.tier
@pytest.mark.parametrize("remat, recomputed", [("full", 8), ("dots", 2)])
def test_remat_recomputes_each_block_in_the_backward_pass(model, remat, recomputed):
    """Per block, "full" recomputes every forward matmul the backward pass reads (q, k, v,
    scores, values, o, gate, up: all but down_proj, whose output only joins the residual),
    "dots" only the 2 attention products, the matmuls with batch dimensions."""
    graphdef, params = model
    batch = synthetic_batch()

    def matmuls(setting):
        fn = make_loss_and_grad(graphdef, load_config(None, SMALL + [f"train.remat={setting}"]))
        return str(jax.make_jaxpr(fn)(params, batch, None)).count("dot_general")

    assert matmuls(remat) - matmuls("none") == recomputed * 2  # n_layers = 2


@pytest.mark.tier
def test_a_full_train_step_with_every_memory_option_matches_the_plain_step(model):
    graphdef, params = model
    batch = synthetic_batch(4)
    results = []
    for extra in ([], ["train.micro_batch_size=2", "train.remat=full", "train.logits_chunk_size=6"]):
        config = load_config(None, SMALL + ["train.warmup_steps=0", "train.learning_rate=1e-2"] + extra)
        optimizer = make_optimizer(config.train)
        step = make_train_step(graphdef, config, optimizer)
        p = jax.tree.map(jnp.copy, params)
        p, opt, m = step(p, optimizer.init(p), batch, None)
        results.append((jax.device_get(p), jax.device_get(m)))
    (p0, m0), (p1, m1) = results
    for k in m0:
        assert float(m1[k]) == pytest.approx(float(m0[k]), rel=2e-5, abs=1e-6), k
    for x, y in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_bfloat16_adam_first_moment_halves_it_and_keeps_the_second_in_float32(model):
    graphdef, params = model
    config = load_config(None, SMALL + ["train.adam_mu_dtype=bfloat16"])
    state = make_optimizer(config.train).init(params)
    adam = state[1][0]  # chain(clip, adamw): adamw's scale_by_adam state
    assert {x.dtype for x in jax.tree.leaves(adam.mu)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(adam.nu)} == {jnp.dtype(jnp.float32)}
    optimizer = make_optimizer(config.train)
    step = make_train_step(graphdef, config, optimizer)
    _, new_state, m = step(jax.tree.map(jnp.copy, params), state, synthetic_batch(), None)
    assert int(m["nonfinite"]) == 0 and {x.dtype for x in jax.tree.leaves(new_state[1][0].mu)} == {
        jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("override, key", [(["train.micro_batch_size=3"], "train.micro_batch_size"),
                                           (["train.micro_batch_size=-1"], "train.micro_batch_size"),
                                           (["train.logits_chunk_size=-2"], "train.logits_chunk_size"),
                                           (["train.remat=some"], "train.remat"),
                                           (["train.adam_mu_dtype=int8"], "train.adam_mu_dtype")])
def test_bad_memory_settings_are_config_errors_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, SMALL + override)
