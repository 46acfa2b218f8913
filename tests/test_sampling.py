"""The jitted sampler agrees with a full forward pass, token by token."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.config import ModelConfig
from jaxreplay.models.transformer import forward, init_params
from jaxreplay.rollout.sampling import (
    Rollout, _phase_ends, categorical, completion_ids, filter_logits, make_sampler, token_entropy,
    token_logprobs)

CFG = ModelConfig(vocab_size=8, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                  max_seq_len=20, tie_embeddings=False, attention_bias=True, qk_norm=True)
PAD, EOS = 0, 1
N_NEW = 10


def params_for(seed, scale=0.3):
    """Init plus noise on every param, so the distributions are far from uniform."""
    graphdef, params = init_params(CFG, 0)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return graphdef, jax.tree.unflatten(treedef, leaves)


GRAPHDEF, PARAMS = params_for(0)
FORWARD = jax.jit(functools.partial(forward, GRAPHDEF))


def prompts(seed, lengths, p):
    """Left-padded prompts of real tokens in [2, V): neither pad nor EOS."""
    tokens = np.asarray(jax.random.randint(jax.random.key(seed), (len(lengths), p), 2, CFG.vocab_size))
    mask = np.arange(p)[None, :] >= (p - np.asarray(lengths))[:, None]
    return jnp.asarray(np.where(mask, tokens, PAD), jnp.int32), jnp.asarray(mask)


LENGTHS = [6, 4, 1, 3, 6, 2, 5, 6]
PROMPT, PROMPT_MASK = prompts(1, LENGTHS, 6)


@functools.lru_cache(maxsize=None)
def rollout(seed=7, stop_ids=(EOS,), **settings) -> Rollout:
    sampler = make_sampler(GRAPHDEF, CFG, max_new_tokens=N_NEW, stop_ids=stop_ids, pad_id=PAD, **settings)
    return jax.tree.map(np.asarray, sampler(PARAMS, PROMPT, PROMPT_MASK, jax.random.key(seed)))


def check_structure(r: Rollout, p=6, stops=(EOS,)):
    """Prompt kept verbatim; completion real through the first stop id, then pad/masked/zero;
    `completion_ids` (what the reward sees) is exactly the tokens the completion mask covers."""
    np.testing.assert_array_equal(r.tokens[:, :p], PROMPT)
    np.testing.assert_array_equal(r.attention_mask[:, :p], PROMPT_MASK)
    assert not r.completion_mask[:, :p].any() and (r.logprobs[:, :p] == 0).all()
    ended_early = 0
    for row in range(r.tokens.shape[0]):
        comp = r.tokens[row, p:]
        eos = np.flatnonzero(np.isin(comp, stops))
        n_real = eos[0] + 1 if len(eos) else N_NEW
        ended_early += n_real < N_NEW
        expect = np.arange(N_NEW) < n_real
        np.testing.assert_array_equal(r.completion_mask[row, p:], expect)
        np.testing.assert_array_equal(r.attention_mask[row, p:], expect)
        assert (comp[n_real:] == PAD).all()
        assert (r.logprobs[row, p:][n_real:] == 0).all()
        assert (r.logprobs[row, p:][:n_real] <= 0).all() and np.isfinite(r.logprobs[row]).all()
        assert not np.isin(comp[:n_real - 1], stops).any()
        np.testing.assert_array_equal(completion_ids(r)[row], comp[:n_real])
    return ended_early


def test_eos_then_pad_and_masks():
    # Which rows hit EOS depends on the tier's random streams: every key's rollout must have
    # the structure, and some key among the first few must give rows of both kinds.
    mixed = 0
    for seed in range(8):
        r = rollout(seed, temperature=1.0)
        assert r.tokens.shape == r.logprobs.shape == (8, 6 + N_NEW) and r.tokens.dtype == np.int32
        assert r.attention_mask.dtype == r.completion_mask.dtype == np.bool_ and r.logprobs.dtype == np.float32
        mixed += 0 < check_structure(r) < 8
    assert mixed, "the fixture should have rows that hit EOS and rows that do not"


def test_every_stop_id_ends_a_completion():
    """Several stop ids (a generation_config with eos_token_id [4, 2]): a row ends at the first of
    any of them, masks and the reward's view included, and some rows end on the second one."""
    sampler = make_sampler(GRAPHDEF, CFG, max_new_tokens=N_NEW, stop_ids=(EOS, 3), pad_id=PAD, temperature=1.0)
    ended_on_second = 0
    for seed in range(4):
        r = jax.tree.map(np.asarray, sampler(PARAMS, PROMPT, PROMPT_MASK, jax.random.key(seed)))
        check_structure(r, stops=(EOS, 3))
        ended_on_second += sum(len(ids) < N_NEW and ids[-1] == 3 for ids in completion_ids(r))
    assert ended_on_second, "the fixture should have rows that stop on the second stop id"


@pytest.mark.tier
def test_logprobs_match_full_forward_with_temperature():
    r = rollout(temperature=0.7)
    check_structure(r)
    ref = np.asarray(token_logprobs(FORWARD(PARAMS, r.tokens, r.attention_mask), r.tokens, 0.7))
    np.testing.assert_allclose(r.logprobs, np.where(r.completion_mask, ref, 0.0), atol=1e-5)


def test_a_long_decode_grows_its_cache_in_phases_and_still_matches_a_full_forward():
    """70 new tokens decode in two loops, over caches of P + 35 then P + 70 slots."""
    assert _phase_ends(70) == [35, 70] and _phase_ends(128) == [32, 64, 96, 128] and _phase_ends(N_NEW) == [N_NEW]
    cfg = dataclasses.replace(CFG, max_seq_len=80)
    sampler = make_sampler(GRAPHDEF, cfg, max_new_tokens=70, temperature=0.7, stop_ids=(), pad_id=PAD)  # no stop id
    r = jax.tree.map(np.asarray, sampler(PARAMS, PROMPT, PROMPT_MASK, jax.random.key(3)))
    assert r.completion_mask[:, 6:].all()
    ref = np.asarray(token_logprobs(FORWARD(PARAMS, r.tokens, r.attention_mask), r.tokens, 0.7))
    np.testing.assert_allclose(r.logprobs, np.where(r.completion_mask, ref, 0.0), atol=1e-5)


def logsumexp(x):
    return x.max() + np.log(np.exp(x - x.max()).sum())


def reference_filter(z, temperature, top_k, top_p):
    """Numpy top-k then top-p (smallest prefix reaching top_p) -> float64 log-probs, -inf if dropped."""
    z = np.asarray(z, np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    kept = order[:top_k] if top_k else order
    probs = np.exp(z[kept] - logsumexp(z[kept]))
    n = int(np.searchsorted(np.cumsum(probs), top_p) + 1)
    kept = kept[:n]
    out = np.full_like(z, -np.inf)
    out[kept] = z[kept] - logsumexp(z[kept])
    return out


def test_filtered_logprobs_match_reference():
    settings = dict(temperature=0.9, top_k=5, top_p=0.7)
    r = rollout(**settings)
    check_structure(r)
    logits = np.asarray(FORWARD(PARAMS, r.tokens, r.attention_mask))
    n_dropped = 0
    for b, t in zip(*np.nonzero(r.completion_mask)):
        ref = reference_filter(logits[b, t - 1], 0.9, 5, 0.7)
        n_dropped += np.isinf(ref).sum()
        assert np.isfinite(ref[r.tokens[b, t]]), "sampled a token the filter drops"
        np.testing.assert_allclose(r.logprobs[b, t], ref[r.tokens[b, t]], atol=1e-5)
    assert n_dropped > 0  # the filter was active


def test_samples_follow_the_filtered_distribution():
    """4000 draws of one next token match exp(reference log-probs) within 5 sigma."""
    n, temperature, top_k, top_p = 4000, 1.5, 4, 0.85
    prompt, mask = prompts(2, [3], 4)
    sampler = make_sampler(GRAPHDEF, CFG, max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p,
                           stop_ids=(EOS,), pad_id=PAD)
    r = sampler(PARAMS, jnp.tile(prompt, (n, 1)), jnp.tile(mask, (n, 1)), jax.random.key(3))
    logits = np.asarray(FORWARD(PARAMS, prompt, mask))[0, -1]
    probs = np.exp(reference_filter(logits, temperature, top_k, top_p))
    assert (probs > 0.05).sum() >= 3, "want a few live tokens for a meaningful check"
    freq = np.bincount(np.asarray(r.tokens[:, -1]), minlength=CFG.vocab_size) / n
    assert (freq[probs == 0] == 0).all()
    np.testing.assert_allclose(freq, probs, atol=5 * np.sqrt(0.25 / n))
    np.testing.assert_allclose(np.asarray(r.logprobs[:, -1]), np.log(probs[np.asarray(r.tokens[:, -1])]), atol=1e-5)


@pytest.mark.parametrize("vocab", [37, 512])
def test_categorical_draws_each_token_with_its_probability_and_never_a_dropped_one(vocab):
    """Two-level inverse-CDF draws: 20000 per row match the row's probabilities within 5 sigma,
    for a vocabulary that does not fill its last block (37) and one that does (512); a row
    with one live token always draws it; -inf tokens never come up."""
    n = 20_000
    rng = np.random.default_rng(vocab)
    logits = rng.normal(size=(3, vocab)) * 2
    logits[0, rng.permutation(vocab)[: vocab // 3]] = -np.inf  # dropped tokens, scattered
    logits[1, :] = -np.inf
    logits[1, vocab - 1] = 0.0  # one live token, in the padded last block
    logits[2, : vocab - 5] = -np.inf  # live only at the end
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    draws = jax.vmap(lambda k: categorical(k, logp))(jax.random.split(jax.random.key(0), n))  # [n, 3]
    probs = np.exp(np.asarray(logp, np.float64))
    for row in range(3):
        freq = np.bincount(np.asarray(draws[:, row]), minlength=vocab) / n
        assert (freq[probs[row] == 0] == 0).all(), f"row {row} drew a dropped token"
        np.testing.assert_allclose(freq, probs[row], atol=5 * np.sqrt(0.25 / n))
    assert (np.asarray(draws[:, 1]) == vocab - 1).all()


@pytest.mark.tier
def test_greedy_is_argmax_of_full_forward():
    r = rollout(greedy=True)
    check_structure(r)
    logits = FORWARD(PARAMS, r.tokens, r.attention_mask)
    comp = r.completion_mask
    argmax = np.asarray(jnp.argmax(logits, axis=-1))
    np.testing.assert_array_equal(r.tokens[:, 1:][comp[:, 1:]], argmax[:, :-1][comp[:, 1:]])
    ref = np.asarray(token_logprobs(logits, r.tokens, 1.0))
    np.testing.assert_allclose(r.logprobs, np.where(comp, ref, 0.0), atol=1e-5)


def test_top_k_1_equals_greedy():
    greedy, top1 = rollout(greedy=True), rollout(top_k=1, temperature=0.5)
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)
    np.testing.assert_array_equal(top1.completion_mask, greedy.completion_mask)
    np.testing.assert_array_equal(top1.logprobs, 0.0)  # one kept token: probability 1


@pytest.mark.tier
def test_no_recompilation_for_new_values_of_the_same_shape():
    sampler = make_sampler(GRAPHDEF, CFG, max_new_tokens=4, temperature=0.8, top_p=0.9, stop_ids=(EOS,), pad_id=PAD)
    outs = []
    for seed in range(3):
        _, params = params_for(10 + seed)
        tokens, mask = prompts(20 + seed, [5, 2, 3, 1], 5)
        outs.append(sampler(params, tokens, mask, jax.random.key(seed)).tokens)
    assert sampler._cache_size() == 1
    assert not np.array_equal(outs[0], outs[1])
    tokens, mask = prompts(30, [5, 2, 3, 1], 7)  # a new prompt length is a new program
    sampler(PARAMS, tokens, mask, jax.random.key(0))
    assert sampler._cache_size() == 2


def test_the_decode_loop_stacks_its_kernels_once_not_every_step():
    """Queries/keys/values and gate/up run as one matmul each per decode step, on kernels
    stacked [D, kv_heads, (groups + 2) * head_dim] and [D, 2, d_ff]; XLA hoists the stacking
    out of the loop, so no loop body builds one."""
    sampler = make_sampler(GRAPHDEF, CFG, max_new_tokens=N_NEW, temperature=0.7, stop_ids=(EOS,), pad_id=PAD)
    hlo = sampler.lower(PARAMS, PROMPT, PROMPT_MASK, jax.random.key(0)).compile().as_text()
    d, kv_heads, groups = CFG.d_model, CFG.n_kv_heads, CFG.n_heads // CFG.n_kv_heads
    stacked = rf"f32\[{d},(?:{kv_heads},{(groups + 2) * CFG.head_dim}|2,{CFG.d_ff})\]"
    built = re.compile(rf"= {stacked}\S* (?!get-tuple-element|parameter)[\w-]+\(")
    computations = {m.group(1): m.group(0) for m in re.finditer(r"\n%?(\S+) \([^\n]*\{\n.*?\n}\n", hlo, re.S)}
    bodies = [computations[name] for name in re.findall(r"body=%?([^,\s]+)", hlo)]
    decode = [body for body in bodies if re.search(stacked, body)]  # not the RNG's inner loops
    assert decode and not any(built.search(body) for body in decode)


def test_too_long_raises():
    sampler = make_sampler(GRAPHDEF, CFG, max_new_tokens=15, stop_ids=(EOS,), pad_id=PAD)
    tokens, mask = prompts(0, [3, 6], 6)
    with pytest.raises(ValueError, match="max_seq_len"):
        sampler(PARAMS, tokens, mask, jax.random.key(0))


def test_token_logprobs_and_entropy_alignment():
    logits = jax.random.normal(jax.random.key(0), (2, 5, CFG.vocab_size)) * 3
    tokens = jax.random.randint(jax.random.key(1), (2, 5), 0, CFG.vocab_size)
    lp = np.asarray(token_logprobs(logits, tokens, 0.5))
    ent = np.asarray(token_entropy(logits, 0.5))
    assert (lp[:, 0] == 0).all() and (ent[:, 0] == 0).all()
    for b in range(2):
        for t in range(1, 5):
            logp = np.asarray(jax.nn.log_softmax(logits[b, t - 1] / 0.5))
            np.testing.assert_allclose(lp[b, t], logp[tokens[b, t]], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(ent[b, t], -(np.exp(logp) * logp).sum(), rtol=1e-5, atol=1e-6)
    # Filtering with everything off is exactly temperature scaling.
    np.testing.assert_allclose(filter_logits(logits, temperature=0.5), logits / 0.5, rtol=1e-6)


# ----------------------------------------------------------------------------------
# Memory: the KV cache's dtype and size, chunked prefill


@pytest.mark.parametrize("chunk, settings", [(1, {}), (2, {}), (4, {}), (5, {}), (6, {}),
                                             (4, dict(greedy=False, temperature=0.7))])
def test_a_chunked_prefill_samples_what_a_whole_one_does(chunk, settings):
    """P = 6: chunks of 1, that divide it, that leave a first chunk of P mod chunk, and the whole prompt."""
    settings = settings or dict(greedy=True)
    whole, chunked = rollout(**settings), rollout(prefill_chunk_size=chunk, **settings)
    np.testing.assert_array_equal(chunked.tokens, whole.tokens)
    np.testing.assert_array_equal(chunked.completion_mask, whole.completion_mask)
    np.testing.assert_allclose(chunked.logprobs, whole.logprobs, atol=1e-5)


def test_a_chunked_prefill_of_a_long_prompt_needs_less_memory():
    """A 256-token prompt: whole, its [B, kv, P x groups, P] attention scores dominate the
    prefill; in chunks of 32 the compiled program's temporaries shrink."""
    cfg = dataclasses.replace(CFG, max_seq_len=264)
    graphdef, params = init_params(cfg, 0)
    tokens, mask = jnp.full((8, 256), 3, jnp.int32), jnp.ones((8, 256), bool)

    def temp_bytes(chunk):
        sampler = make_sampler(graphdef, cfg, max_new_tokens=4, stop_ids=[EOS], pad_id=PAD, prefill_chunk_size=chunk)
        return sampler.lower(params, tokens, mask, jax.random.key(0)).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(32) < temp_bytes(0) / 2


def test_the_kv_cache_is_stored_in_the_configured_dtype():
    """A float32 model with a bfloat16 cache: the cache buffers are bf16 (none are by default),
    and the log-probs it reports stay within bfloat16 rounding of a float32 forward pass."""
    from jaxreplay.config import load_config
    from jaxreplay.rollout.sampling import make_run_samplers

    def cache_text(kv_dtype):
        config = load_config(None, [f"sampling.kv_cache_dtype={kv_dtype}"] if kv_dtype else [])
        graphdef, params = init_params(config.model, 0)
        tokens, mask = prompts(2, [5, 3, 7, 1], 7)
        sample, _ = make_run_samplers(graphdef, config, stop_ids=[EOS], pad_id=PAD)
        return sample.lower(params, tokens, mask, jax.random.key(0)).as_text()

    m = load_config(None).model
    cache = re.compile(rf"tensor<4x{m.n_kv_heads}x\d+x{m.head_dim}xbf16>")  # [B, kv_heads, slots, head_dim]
    assert cache.search(cache_text("bfloat16")) and "bf16" not in cache_text(None)
    r = rollout(greedy=True, kv_cache_dtype="bfloat16")
    check_structure(r)
    ref = np.asarray(token_logprobs(FORWARD(PARAMS, r.tokens, r.attention_mask), r.tokens, 1.0))
    np.testing.assert_allclose(r.logprobs, np.where(r.completion_mask, ref, 0.0), atol=3e-2)


def test_kv_cache_bytes_counts_every_slot_of_every_layer():
    from jaxreplay.rollout.sampling import kv_cache_bytes

    per_row_slot = 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim  # keys and values
    assert kv_cache_bytes(CFG, 8, 6, N_NEW) == 8 * (6 + N_NEW) * per_row_slot * 4  # float32 compute
    assert kv_cache_bytes(CFG, 8, 6, N_NEW, "bfloat16") == 8 * (6 + N_NEW) * per_row_slot * 2
