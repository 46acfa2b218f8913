"""LoRA (`model.lora`): the adapters' layout, step 0 is the base, only adapters train, the
samplers' log-probs are the learner's, checkpoints hold adapters and refuse another base,
and bad settings are refused at the edge."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.config import ConfigError, LoraConfig, ModelConfig, load_config
from jaxreplay.models import lora
from jaxreplay.models import transformer as T

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_model(targets=ALL, rank=4, alpha=8.0, **kw) -> ModelConfig:
    return ModelConfig(lora=LoraConfig(targets=targets, rank=rank, alpha=alpha), **kw)


def leaves_by_name(tree) -> dict:
    return {"/".join(lora._names(p)): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def with_nonzero_b(params, value=0.05):
    """Adapters as if trained: B no longer zero."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x + value * jnp.cos(jnp.arange(x.size, dtype=x.dtype)).reshape(x.shape)
        if lora._names(p)[-1] == "lora_b" else x, params)


def test_layout_names_shapes_and_peft_init():
    cfg = lora_model(targets=("q_proj", "down_proj"), rank=3)
    _, params = T.init_params(cfg, 0)
    adapters, base = lora.split_adapters(params)
    names = leaves_by_name(adapters)
    assert sorted(names) == sorted(f"layers/{i}/{m}/{p}/lora_{f}" for i in range(cfg.n_layers)
                                   for m, p in (("attn", "q_proj"), ("mlp", "down_proj")) for f in "ab")
    d, hd = cfg.d_model, cfg.head_dim
    assert names["layers/0/attn/q_proj/lora_a"].shape == (d, 3)
    assert names["layers/0/attn/q_proj/lora_b"].shape == (3, cfg.n_heads * hd)
    assert names["layers/1/mlp/down_proj/lora_a"].shape == (cfg.d_ff, 3)
    for name, x in names.items():
        if name.endswith("lora_b"):
            assert not np.any(np.asarray(x)), name  # B = 0: step 0 is the base
        else:  # PEFT's kaiming_uniform(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in)), not all alike
            bound = 1 / np.sqrt(x.shape[0])
            assert np.all(np.abs(np.asarray(x)) <= bound) and np.std(np.asarray(x)) > bound / 3
    # the base's part is the model without LoRA, value for value (the base init ignores the adapters)
    _, plain = T.init_params(lora.base_model_config(cfg), 0)
    assert jax.tree.structure(base) == jax.tree.structure(plain)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(plain)))


def test_no_targets_is_the_plain_model():
    _, params = T.init_params(ModelConfig(), 0)
    adapters, _ = lora.split_adapters(params)
    assert jax.tree.leaves(adapters) == []
    assert lora.count_trainable(params) == T.count_params(params)


def test_step_0_equals_the_base():
    cfg = lora_model()
    g0, base = T.init_params(lora.base_model_config(cfg), 7)
    graphdef, params = T.with_adapters(cfg, base, seed=1)
    tokens = jnp.array([[3, 5, 7, 9, 11, 2], [4, 6, 8, 10, 12, 1]])
    mask = jnp.ones_like(tokens, bool)
    assert np.array_equal(T.forward(g0, base, tokens, mask), T.forward(graphdef, params, tokens, mask))
    # the adapters are live: a non-zero B changes the logits
    assert not np.allclose(T.forward(g0, base, tokens, mask),
                           T.forward(graphdef, with_nonzero_b(params), tokens, mask))


def test_merged_kernels_equal_adapters_on_the_fly():
    cfg = lora_model(rank=2, alpha=5.0)
    graphdef, params = T.init_params(cfg, 0)
    params = with_nonzero_b(params)
    merged = lora.merge_adapters(params, cfg)
    g0, _ = T.abstract_model(lora.base_model_config(cfg))
    tokens = jnp.array([[3, 5, 7, 9, 11, 2]])
    mask = jnp.ones_like(tokens, bool)
    np.testing.assert_allclose(T.forward(g0, merged, tokens, mask), T.forward(graphdef, params, tokens, mask),
                               atol=2e-5)


@pytest.mark.parametrize("override, message", [
    ("model.lora.targets=[q_proj,qkv]", "model.lora.targets[1]: 'qkv' is not one of q_proj"),
    ("model.lora.rank=0", "model.lora.rank: must be > 0"),
    ("model.lora.rank=-2", "model.lora.rank: must be > 0"),
    ("model.lora.alpha=0", "model.lora.alpha: must be > 0"),
    ("model.lora.targets=[v_proj,v_proj]", "model.lora.targets: v_proj is named twice"),
])
def test_bad_settings_refused_in_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.lora.targets=[q_proj]", override])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
