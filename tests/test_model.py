"""The decoder: shapes, causality, left padding, variants, KV cache, low precision."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxreplay.compat import value_of
from jaxreplay.config import ModelConfig
from jaxreplay.models.transformer import (
    KVCache, Transformer, apply, count_params, forward, init_cache, init_params, positions_from_mask, split)
from jaxreplay.models.transformer import grouped_qkv_projection, stacked_projection

TINY = ModelConfig(vocab_size=24, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                   max_seq_len=32)
# Every option on at once: the cache and padding tests cover their code paths too.
FULL = dataclasses.replace(TINY, tie_embeddings=False, attention_bias=True, qk_norm=True)


def perturbed(cfg, seed=0, scale=0.1):
    """Init, then shift every param (norm scales, biases too) so no option is a no-op."""
    graphdef, params = init_params(cfg, seed)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
    leaves = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return graphdef, jax.tree.unflatten(treedef, leaves)


@functools.lru_cache(maxsize=None)
def jit_forward(graphdef):
    return jax.jit(functools.partial(forward, graphdef))


def random_tokens(seed, shape, vocab):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab, jnp.int32)


@pytest.mark.tier
def test_shapes_and_dtypes():
    graphdef, params = init_params(TINY, 0)
    tokens = random_tokens(0, (3, 7), TINY.vocab_size)
    mask = jnp.ones((3, 7), bool)
    logits, cache = apply(graphdef, params, tokens, positions_from_mask(mask), mask)
    assert logits.shape == (3, 7, TINY.vocab_size) and logits.dtype == jnp.float32
    assert cache is None
    assert np.isfinite(np.asarray(logits)).all()

    full_cache = init_cache(TINY, 3, 10)
    assert isinstance(full_cache, KVCache)
    assert len(full_cache.k) == len(full_cache.v) == TINY.n_layers
    assert full_cache.k[0].shape == (3, TINY.n_kv_heads, 10, TINY.head_dim)
    key_mask = jnp.zeros((3, 10), bool).at[:, :7].set(True)
    logits2, new_cache = apply(graphdef, params, tokens, positions_from_mask(mask), key_mask, full_cache, 0)
    assert logits2.shape == logits.shape
    assert jax.tree.map(jnp.shape, new_cache) == jax.tree.map(jnp.shape, full_cache)
    assert new_cache.v[0].dtype == full_cache.v[0].dtype
    np.testing.assert_allclose(logits2, logits, atol=1e-5)


def test_causal():
    graphdef, params = perturbed(FULL)
    tokens = random_tokens(1, (2, 9), FULL.vocab_size)
    changed = tokens.at[:, 5].set((tokens[:, 5] + 1) % FULL.vocab_size)
    mask = jnp.ones((2, 9), bool)
    a, b = jit_forward(graphdef)(params, tokens, mask), jit_forward(graphdef)(params, changed, mask)
    np.testing.assert_allclose(a[:, :5], b[:, :5], atol=1e-6)
    assert np.abs(np.asarray(a[:, 5:] - b[:, 5:])).min(axis=-1).max() > 1e-4  # every later position moved


def test_positions_count_real_tokens_only():
    mask = jnp.array([[False, False, True, True, True], [True, True, True, False, False]])
    np.testing.assert_array_equal(positions_from_mask(mask), [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2]])


@pytest.mark.parametrize("cfg", [TINY, FULL], ids=["default", "all_options"])
def test_left_padding_invariance(cfg):
    graphdef, params = perturbed(cfg)
    seq = random_tokens(2, (6,), cfg.vocab_size)
    # Row 0 unpadded, row 1 with 4 pads of arbitrary token ids on the left.
    junk = random_tokens(3, (4,), cfg.vocab_size)
    tokens = jnp.stack([jnp.concatenate([seq, junk]), jnp.concatenate([junk, seq])])
    mask = jnp.array([[True] * 6 + [False] * 4, [False] * 4 + [True] * 6])
    logits = jit_forward(graphdef)(params, tokens, mask)
    np.testing.assert_allclose(logits[1, 4:], logits[0, :6], atol=1e-5)
    alone = jit_forward(graphdef)(params, seq[None], jnp.ones((1, 6), bool))
    np.testing.assert_allclose(logits[1, 4:], alone[0], atol=1e-5)


def expected_param_count(c: ModelConfig) -> int:
    d, hd = c.d_model, c.head_dim
    attn = d * c.n_heads * hd * 2 + d * c.n_kv_heads * hd * 2  # q, o; k, v
    attn += (c.n_heads + 2 * c.n_kv_heads) * hd if c.attention_bias else 0
    attn += 2 * hd if c.qk_norm else 0
    layer = attn + 3 * d * c.d_ff + 2 * d
    return c.vocab_size * d + c.n_layers * layer + d + (0 if c.tie_embeddings else d * c.vocab_size)


VARIANTS = {
    "mha": dict(n_kv_heads=4),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "untied": dict(tie_embeddings=False),
    "bias": dict(attention_bias=True),
    "qk_norm": dict(qk_norm=True),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants_run_and_count(name):
    cfg = dataclasses.replace(TINY, **VARIANTS[name])
    graphdef, params = init_params(cfg, 0)
    assert count_params(params) == expected_param_count(cfg)
    tokens = random_tokens(4, (2, 5), cfg.vocab_size)
    logits = forward(graphdef, params, tokens, jnp.ones((2, 5), bool))
    assert logits.shape == (2, 5, cfg.vocab_size) and np.isfinite(np.asarray(logits)).all()


def test_variant_param_deltas_and_names():
    base = count_params(init_params(TINY, 0)[1])
    count = lambda **kw: count_params(init_params(dataclasses.replace(TINY, **kw), 0)[1])
    d, v, hd, n = TINY.d_model, TINY.vocab_size, TINY.head_dim, TINY.n_layers
    assert count(tie_embeddings=False) - base == d * v
    assert count(attention_bias=True) - base == n * (TINY.n_heads + 2 * TINY.n_kv_heads) * hd
    assert count(qk_norm=True) - base == n * 2 * hd
    assert count(n_kv_heads=4) - base == n * 2 * d * 2 * hd  # two more kv heads in k and v

    # Plain names and [in, out] kernels: the HF importer's contract.
    model = Transformer(FULL, rngs=nnx.Rngs(0))
    _, p = split(model)
    attn = p["layers"][0]["attn"]
    assert value_of(attn["q_proj"]["kernel"]).shape == (d, FULL.n_heads * hd)
    assert value_of(attn["k_proj"]["bias"]).shape == (FULL.n_kv_heads * hd,)
    assert "bias" not in attn["o_proj"]
    assert value_of(attn["q_norm"]["scale"]).shape == (hd,)
    assert value_of(p["layers"][1]["mlp"]["down_proj"]["kernel"]).shape == (FULL.d_ff, d)
    assert value_of(p["lm_head"]["kernel"]).shape == (d, v)
    assert value_of(p["embed"]["embedding"]).shape == (v, d)
    assert {"input_norm", "post_attn_norm"} <= set(p["layers"][0])
    assert "final_norm" in p


@pytest.mark.tier
@pytest.mark.parametrize("cfg", [TINY, FULL], ids=["default", "all_options"])
def test_cache_decode_matches_full_forward(cfg):
    """Prefill a left-padded prompt, then feed one token (and a 2-token chunk) at a time."""
    graphdef, params = perturbed(cfg)
    b, length, prefill = 3, 12, 5
    tokens = random_tokens(5, (b, length), cfg.vocab_size)
    n_pad = jnp.array([0, 2, 4])
    mask = jnp.arange(length)[None, :] >= n_pad[:, None]
    want = jit_forward(graphdef)(params, tokens, mask)
    positions = positions_from_mask(mask)

    step = jax.jit(functools.partial(apply, graphdef))
    cache = init_cache(cfg, b, length)
    key_mask = jnp.zeros((b, length), bool).at[:, :prefill].set(mask[:, :prefill])
    got, cache = step(params, tokens[:, :prefill], positions[:, :prefill], key_mask, cache, 0)
    chunks = [got]
    t = prefill
    for width in [1, 1, 2, 1, 1, 1]:
        key_mask = key_mask.at[:, t:t + width].set(True)
        got, cache = step(params, tokens[:, t:t + width], positions[:, t:t + width], key_mask, cache, t)
        chunks.append(got)
        t += width
    assert t == length
    got = jnp.concatenate(chunks, axis=1)
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-5)


def test_stacked_projections_compute_what_the_separate_ones_do():
    """The decode path's one matmul for the MLP's gate and up (any two Linears of one shape)
    gives each projection's output, biases included."""
    graphdef, params = perturbed(FULL)
    layer = nnx.merge(graphdef, params).layers[0]
    x = jax.random.normal(jax.random.key(3), (3, 1, FULL.d_model))
    for a, b in [(layer.attn.k_proj, layer.attn.v_proj), (layer.mlp.gate_proj, layer.mlp.up_proj)]:
        got = stacked_projection(x, a, b)
        for g, want in zip(got, (a(x), b(x))):
            assert g.shape == want.shape
            np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(layer.mlp(x, stacked=True), layer.mlp(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cfg", [FULL, dataclasses.replace(FULL, n_heads=4, n_kv_heads=4, attention_bias=False)],
                         ids=["grouped-with-bias", "one-query-per-kv-head"])
def test_the_decode_steps_one_qkv_matmul_computes_each_projection(cfg):
    """Queries, keys and values of a decode step come from one matmul; each keeps its own
    heads (query head h next to kv head h // groups), biases included."""
    graphdef, params = perturbed(cfg)
    attn = nnx.merge(graphdef, params).layers[0].attn
    x = jax.random.normal(jax.random.key(4), (3, 1, cfg.d_model))
    got = grouped_qkv_projection(x, attn.q_proj, attn.k_proj, attn.v_proj, cfg.n_kv_heads)
    for g, want in zip(got, (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))):
        assert g.shape == want.shape
        np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_bfloat16_compute(param_dtype):
    lo_cfg = dataclasses.replace(FULL, compute_dtype="bfloat16", param_dtype=param_dtype)
    graphdef, params = init_params(lo_cfg, 0)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(param_dtype)}
    tokens = random_tokens(6, (2, 8), FULL.vocab_size)
    mask = jnp.ones((2, 8), bool).at[1, :3].set(False)
    logits = forward(graphdef, params, tokens, mask)
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()
    assert init_cache(lo_cfg, 2, 8).k[0].dtype == jnp.bfloat16

    # The same weights in float32 give nearly the same logits (bf16 keeps ~3 digits).
    f32_graphdef, _ = init_params(FULL, 0)
    f32_params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    ref = forward(f32_graphdef, f32_params, tokens, mask)
    real = np.asarray(mask)
    ref = np.asarray(ref)[real]
    np.testing.assert_allclose(np.asarray(logits)[real], ref, atol=0.05 * np.abs(ref).max())


def numpy_reference(cfg, params, tokens):
    """The HF Llama/Qwen2/Qwen3 forward for one unpadded row, written out in float64 numpy:
    rotate_half RoPE, query head h reading kv head h // (n_heads / n_kv_heads), q/k norm
    before RoPE, biases on q/k/v only."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(params))
    norm = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * w
    lin = lambda x, m: x @ m["kernel"] + m.get("bias", 0.0)
    t, hd, groups = len(tokens), cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, hd, 2) / hd)
    ang = np.concatenate([np.outer(np.arange(t), inv)] * 2, axis=-1)[:, None, :]  # [T, 1, hd]
    rot = lambda x: x * np.cos(ang) + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * np.sin(ang)
    x = p["embed"]["embedding"][tokens]
    for i in range(cfg.n_layers):
        layer = p["layers"][i]
        a = layer["attn"]
        h = norm(x, layer["input_norm"]["scale"])
        q = lin(h, a["q_proj"]).reshape(t, cfg.n_heads, hd)
        k = lin(h, a["k_proj"]).reshape(t, cfg.n_kv_heads, hd)
        v = lin(h, a["v_proj"]).reshape(t, cfg.n_kv_heads, hd)
        if cfg.qk_norm:
            q, k = norm(q, a["q_norm"]["scale"]), norm(k, a["k_norm"]["scale"])
        q, k = rot(q), rot(k)
        out = np.zeros((t, cfg.n_heads, hd))
        for head in range(cfg.n_heads):
            s = q[:, head] @ k[:, head // groups].T / np.sqrt(hd) + np.triu(np.full((t, t), -np.inf), 1)
            w = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (w / w.sum(-1, keepdims=True)) @ v[:, head // groups]
        x = x + lin(out.reshape(t, -1), a["o_proj"])
        h = norm(x, layer["post_attn_norm"]["scale"])
        m = layer["mlp"]
        gate = lin(h, m["gate_proj"])
        x = x + lin(gate / (1 + np.exp(-gate)) * lin(h, m["up_proj"]), m["down_proj"])
    x = norm(x, p["final_norm"]["scale"])
    return x @ (p["embed"]["embedding"].T if cfg.tie_embeddings else p["lm_head"]["kernel"])


@pytest.mark.tier
@pytest.mark.parametrize("cfg", [TINY, FULL, dataclasses.replace(TINY, n_kv_heads=1, rope_theta=50.0)],
                         ids=["default", "all_options", "mqa_theta"])
def test_matches_numpy_reference(cfg):
    graphdef, params = perturbed(cfg)
    tokens = random_tokens(7, (1, 9), cfg.vocab_size)
    logits = jit_forward(graphdef)(params, tokens, jnp.ones((1, 9), bool))
    np.testing.assert_allclose(logits[0], numpy_reference(cfg, params, np.asarray(tokens[0])), atol=2e-5)
