"""Gemma's features in our own decoder, without transformers (its parity is tests/test_hf_gemma.py):
the sliding window's reach, the engine's behaviour log-probs against the learner's re-scoring on a
Gemma-shaped model decoded past its window, LoRA on Gemma's modules, refusals, and a short run."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.compat import value_of
from jaxreplay.config import LoraConfig, ModelConfig
from jaxreplay.learn.scoring import sequence_scores
from jaxreplay.models.errors import HFModelError
from jaxreplay.models.hf import family_of, peft_name, save_peft_adapters
from jaxreplay.models.transformer import forward, init_params, is_local_layer, score_hidden
from jaxreplay.rollout.engine import JaxEngine, PromptGroup
from test_bad_input import assert_one_line_exit_2, jaxreplay

WINDOW = 3
# Gemma 3's block, every feature on, and Gemma 2's soft-caps too: layers local, global, local, global.
GEMMA = ModelConfig(vocab_size=16, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                    max_seq_len=20, qk_norm=True, mlp_activation="gelu_tanh", norm_plus_one=True, post_norms=True,
                    scale_embeddings=True, query_pre_attn_scalar=12, attn_logit_softcap=20.0,
                    final_logit_softcap=15.0, sliding_window=WINDOW, sliding_window_pattern=2,
                    rope_local_theta=10_000.0, rope_theta=1_000_000.0, rope_scaling_factor=8.0,
                    rope_scaling_type="linear")
PAD, EOS = 0, 1
P, N = 6, 10


def noisy(cfg, seed=0, scale=0.3):
    """Init plus noise on every param, so the (1 + w) norms and distributions are far from their init."""
    graphdef, params = init_params(cfg, 0)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return graphdef, jax.tree.unflatten(treedef, [x + scale * jax.random.normal(k, x.shape)
                                                  for x, k in zip(leaves, keys)])


def test_the_layer_pattern_is_every_kth_global():
    assert [is_local_layer(GEMMA, i) for i in range(4)] == [True, False, True, False]
    gemma3 = dataclasses.replace(GEMMA, n_layers=12, sliding_window_pattern=6)
    assert [i for i in range(12) if not is_local_layer(gemma3, i)] == [5, 11]
    assert not any(is_local_layer(ModelConfig(), i) for i in range(2))  # Llama/Qwen: no window


def test_a_local_layer_sees_exactly_its_window():
    """One local layer: the logits at position t move with tokens t - WINDOW + 1 .. t and no other."""
    cfg = dataclasses.replace(GEMMA, n_layers=1)
    graphdef, params = noisy(cfg)
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (1, 12), 2, cfg.vocab_size), np.int32)
    changed = tokens.copy()
    changed[0, 4] = (tokens[0, 4] + 1) % cfg.vocab_size
    logits = [np.asarray(forward(graphdef, params, jnp.asarray(t), jnp.ones(t.shape, bool))) for t in (tokens, changed)]
    moved = np.abs(logits[0] - logits[1]).max(axis=-1)[0] > 1e-6
    assert moved.tolist() == [t in range(4, 4 + WINDOW) for t in range(12)]


def test_engine_logprobs_equal_the_learners_past_the_window():
    """Rows decoded to P + N = 16 positions (over 5 windows) in the engine's pool: each token's
    behaviour log-prob is the learner's re-scoring of the finished row (float32, 1e-5)."""
    graphdef, params = noisy(GEMMA)
    lengths = [6, 4, 1, 5]
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (4, P), 2, GEMMA.vocab_size), np.int32)
    mask = np.arange(P)[None, :] >= (P - np.asarray(lengths))[:, None]
    engine = JaxEngine(graphdef, GEMMA, params, slots=4, group_size=2, prompt_len=P, max_new_tokens=N, chunk_steps=3,
                       temperature=0.8, stop_ids=(EOS,), pad_id=PAD)
    engine.submit([PromptGroup(i, np.where(mask[i], tokens[i], PAD), mask[i], jax.random.key(i)) for i in range(4)])
    done = {}
    while engine.pending():
        engine.step()
        done.update((c.tag, c.rollout) for c in engine.collect())
    stack = lambda field: np.concatenate([getattr(done[i], field) for i in range(4)])
    rows, attention, completion = stack("tokens"), stack("attention_mask"), stack("completion_mask")
    assert completion.sum(axis=1).max() == N  # some row decodes far past the window
    h, unembed = score_hidden(graphdef, params, jnp.asarray(rows), jnp.asarray(attention))
    learner, _ = sequence_scores(h, jnp.asarray(rows), unembed, temperature=0.8, with_entropy=False)
    np.testing.assert_allclose(stack("logprobs"), np.where(completion, np.asarray(learner), 0.0), atol=1e-5)


def test_lora_targets_gemmas_attention_and_mlp_by_their_names(tmp_path):
    cfg = dataclasses.replace(GEMMA, lora=LoraConfig(targets=("q_proj", "v_proj", "gate_proj", "down_proj"), rank=2))
    _, params = init_params(cfg, 0)
    flat = {tuple(map(str, p)) for p, _ in __import__("flax").nnx.to_flat_state(params)}
    for module in (("attn", "q_proj"), ("attn", "v_proj"), ("mlp", "gate_proj"), ("mlp", "down_proj")):
        assert ("layers", "3", *module, "lora_a") in flat
    assert ("layers", "0", "attn", "k_proj", "lora_a") not in flat
    assert peft_name(("layers", 1, "mlp", "gate_proj", "lora_a")) == \
        "base_model.model.model.layers.1.mlp.gate_proj.lora_A.weight"
    save_peft_adapters(tmp_path, cfg, params)
    written = json.loads((tmp_path / "adapter_config.json").read_text())
    assert written["target_modules"] == ["down_proj", "gate_proj", "q_proj", "v_proj"]


def test_the_export_family_follows_the_features():
    assert family_of(GEMMA) == "gemma3_text"
    assert family_of(dataclasses.replace(GEMMA, qk_norm=False)) == "gemma2"
    assert family_of(ModelConfig(qk_norm=True)) == "qwen3"
    with pytest.raises(HFModelError, match="part of Gemma's block"):
        family_of(dataclasses.replace(GEMMA, post_norms=False))  # no HF family holds it
    with pytest.raises(HFModelError, match="part of Gemma's block"):
        family_of(ModelConfig(sliding_window=4, sliding_window_pattern=2))


def test_an_unsupported_family_is_one_line_exit_2(tmp_path):
    """Gemma 3 4B+'s multimodal model_type (gemma3, the text model nested in it) is not ours."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": {}}))
    result = jaxreplay("compile", "configs/demo.yaml", f"model.hf_config={tmp_path}", timeout=120)
    assert_one_line_exit_2(result, "model_type='gemma3'")


@pytest.mark.slow
def test_a_gemma_shaped_demo_trains(tmp_path):
    """The demo's task on a tiny Gemma 3-shaped model (local and global layers, every Gemma feature): a few
    steps run, with finite losses, and the policy moves."""
    from test_train import run

    gemma = ["model.n_layers=2", "model.qk_norm=true", "model.mlp_activation=gelu_tanh", "model.norm_plus_one=true",
             "model.post_norms=true", "model.scale_embeddings=true", "model.query_pre_attn_scalar=16",
             "model.sliding_window=4", "model.sliding_window_pattern=2", "model.rope_local_theta=10000",
             "model.attn_logit_softcap=50", "model.final_logit_softcap=30"]
    config, summary = run(tmp_path, "train.steps=3", *gemma)
    assert config.model.sliding_window == 4 and config.model.post_norms
    from jaxreplay.train.metrics import read_metrics

    records = read_metrics(config.run.dir)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in records if "loss" in r)
