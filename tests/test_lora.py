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


# ---------------------------------------------------------------------------------------------
# Learning: only the adapters train; the samplers' log-probs are the learner's


SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
         "model.d_ff=64", "task.max_digits=2", "model.attention_bias=true"]
LORA = ["model.lora.targets=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]", "model.lora.rank=2"]


def lora_batch(config, advantage=1.0, engine=False):
    """(graphdef, params with trained-looking adapters, a batch the static sampler (or the engine) drew
    from them, with frozen behaviour log-probs)."""
    from jaxreplay.rollout.rollouts import to_device_batch
    from jaxreplay.rollout.sampling import make_sampler
    from jaxreplay.tasks.registry import make_task

    task = make_task(config.task)
    g0, base = T.init_params(lora.base_model_config(config.model), 0)
    graphdef, params = T.with_adapters(config.model, base, seed=1)
    params = with_nonzero_b(params, 0.2)
    s = config.sampling
    prompts, mask = task.encode_prompts(task.train_problems(0, 0, 8))
    if engine:
        from jaxreplay.rollout.engine import JaxEngine, PromptGroup

        eng = JaxEngine(graphdef, config.model, params, slots=4, group_size=2, prompt_len=prompts.shape[1],
                        max_new_tokens=s.max_new_tokens, chunk_steps=3, temperature=s.temperature,
                        stop_ids=task.tokenizer.eos_ids, pad_id=task.tokenizer.pad_id)
        eng.submit([PromptGroup(i, prompts[i], mask[i], jax.random.key(i)) for i in range(4)])
        done = []
        while eng.pending():
            eng.step()
            done += eng.collect()
        r = {f: np.concatenate([getattr(c.rollout, f) for c in sorted(done, key=lambda c: c.tag)])
             for f in ("tokens", "attention_mask", "completion_mask", "logprobs")}
    else:
        sample = make_sampler(graphdef, config.model, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                              stop_ids=task.tokenizer.eos_ids, pad_id=task.tokenizer.pad_id)
        out = jax.device_get(sample(params, prompts, mask, jax.random.PRNGKey(1)))
        r = {f: getattr(out, f) for f in ("tokens", "attention_mask", "completion_mask", "logprobs")}
    batch = {**r, "advantage": np.full(len(r["tokens"]), advantage, np.float32)}
    return graphdef, params, to_device_batch(batch)


def test_only_the_adapters_change_and_only_they_have_optimizer_state():
    from jaxreplay.learn.learner import make_optimizer, make_train_step

    config = load_config(None, SMALL + LORA + ["train.learning_rate=1e-2", "train.warmup_steps=0"])
    graphdef, params, batch = lora_batch(config)
    optimizer = make_optimizer(config.train)
    opt_state = optimizer.init(params)
    adapters, base = lora.split_adapters(params)
    n_adapters = sum(x.size for x in jax.tree.leaves(adapters))
    moments = sum(x.size for x in jax.tree.leaves(opt_state) if x.ndim)  # Adam's mu and nu: 2 per adapter scalar
    assert moments == 2 * n_adapters
    before = jax.tree.map(np.asarray, params)
    new, _, m = make_train_step(graphdef, config, optimizer)(params, opt_state, batch, None)
    assert float(m["grad_norm"]) > 0 and int(m["nonfinite"]) == 0
    new_adapters, new_base = lora.split_adapters(new)
    old_adapters, old_base = lora.split_adapters(before)
    for a, b in zip(jax.tree.leaves(new_base), jax.tree.leaves(old_base)):
        assert np.array_equal(np.asarray(a), b)  # the base is frozen, bit for bit
    changed = [not np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(new_adapters),
                                                                     jax.tree.leaves(old_adapters))]
    assert all(changed)


def test_kl_reference_is_the_base_with_adapters_off():
    """kl_ref is 0 at step 0 (B = 0: the policy is the base), and positive once the adapters moved,
    with no reference copy passed in."""
    from jaxreplay.learn.learner import make_optimizer, make_train_step
    from jaxreplay.learn.trainable import initial_reference

    config = load_config(None, SMALL + LORA + ["train.kl_coef=0.1"])
    graphdef, params, batch = lora_batch(config)
    assert initial_reference(params, config.train.kl_coef) is None
    optimizer = make_optimizer(config.train)
    step = make_train_step(graphdef, config, optimizer)
    zeroed = jax.tree_util.tree_map_with_path(lambda p, x: x * 0 if lora._names(p)[-1] == "lora_b" else x.copy(),
                                              params)  # a copy: the step donates its params
    _, _, m0 = step(zeroed, optimizer.init(zeroed), batch, None)
    assert float(m0["kl_ref"]) == pytest.approx(0.0, abs=1e-7)
    _, _, m1 = step(params, optimizer.init(params), batch, None)
    assert float(m1["kl_ref"]) > 1e-4


@pytest.mark.parametrize("engine", [False, True], ids=["static", "engine"])
@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_behaviour_logprobs_equal_the_learners(engine, dtype, tolerance):
    """Rollouts drawn with base + adapters (on the fly, through the decode step's fused projections)
    score the same under the learner's forward pass: ratio 1 within float32 (or bfloat16) rounding."""
    from jaxreplay.learn.scoring import sequence_scores

    config = load_config(None, SMALL + LORA + [f"model.param_dtype={dtype}", f"model.compute_dtype={dtype}",
                                               "sampling.temperature=0.7"])
    graphdef, params, batch = lora_batch(config, engine=engine)
    h, unembed = T.score_hidden(graphdef, params, batch["tokens"], batch["attention_mask"])
    learner, _ = sequence_scores(h, batch["tokens"], unembed, temperature=0.7, with_entropy=False)
    completion = np.asarray(batch["completion_mask"])
    assert completion.sum() > 0
    np.testing.assert_allclose(np.asarray(batch["logprobs"]), np.where(completion, np.asarray(learner), 0.0),
                               atol=tolerance)
    # the adapters matter: the base alone scores these tokens differently
    _, base = lora.split_adapters(params)
    g0, _ = T.abstract_model(lora.base_model_config(config.model))
    h0, unembed0 = T.score_hidden(g0, base, batch["tokens"], batch["attention_mask"])
    base_lp, _ = sequence_scores(h0, batch["tokens"], unembed0, temperature=0.7, with_entropy=False)
    assert np.abs(np.where(completion, np.asarray(base_lp) - np.asarray(learner), 0)).max() > 10 * tolerance
