"""Gemma 2 and Gemma 3 (text) against transformers' own models: logits, greedy decoding on the
static sampler and on the rollout engine, and the bridge both ways.

Each model is tiny and random, made by transformers itself with every weight perturbed (so the
(1 + w) norms' zero init is not what is tested), four layers with a sliding window of 5 and
sequences well past it, so the local layers' window, the global layers and, in Gemma 3, the two
RoPE bases (the global one linearly scaled) all show in the logits.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

torch = pytest.importorskip("torch", reason="the 'parity' extra (CPU torch) is not installed")
pytestmark = pytest.mark.needs_torch

from jaxreplay.models.hf import load_hf_model, read_model_config, save_hf_model  # noqa: E402
from jaxreplay.models.tokenizer import load_tokenizer  # noqa: E402
from jaxreplay.models.transformer import forward  # noqa: E402
from jaxreplay.rollout.sampling import make_sampler  # noqa: E402
from tiny_hf import (GEMMA, engine_greedy, flat_params, hf_greedy, hf_logits, save_random_hf_model,  # noqa: E402
                     write_char_tokenizer)

VOCAB, WINDOW = 128, 5
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.1,
             sliding_window=WINDOW, query_pre_attn_scalar=24, eos_token_id=4, pad_token_id=0, bos_token_id=1)
GEMMA3 = dict(sliding_window_pattern=3, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
              rope_scaling={"rope_type": "linear", "factor": 8.0})
# Untied: a random model whose head is its sqrt(D)-scaled embedding greedily repeats its input token,
# which would make greedy parity vacuous; the tied one (as published Gemmas are) is checked on logits.
FAMILIES = {
    # layers local, local, global, local; the global layers' RoPE linearly scaled, as Gemma 3 4B+'s
    "gemma3": (transformers.Gemma3TextConfig, dict(GEMMA3, tie_word_embeddings=False)),
    "gemma3_tied": (transformers.Gemma3TextConfig, dict(GEMMA3, tie_word_embeddings=True)),
    # alternating local and global; small soft-caps so that tanh bends the random model's scores and logits
    "gemma2": (transformers.Gemma2Config, dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                               rope_theta=10_000.0, tie_word_embeddings=False)),
}
MODEL_TYPE = {"gemma3": "gemma3_text", "gemma3_tied": "gemma3_text", "gemma2": "gemma2"}


def make_gemma(family: str, path: Path, seed: int = 0):
    config_cls, extra = FAMILIES[family]
    config = config_cls(**SHAPE, **extra)
    model = save_random_hf_model(config, path, seed)
    write_char_tokenizer(path, GEMMA)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def gemma(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, make_gemma(request.param, path)


def test_config_json_becomes_the_gemma_features(gemma):
    family, path, _ = gemma
    cfg = read_model_config(path)
    assert (cfg.norm_plus_one, cfg.post_norms, cfg.scale_embeddings, cfg.mlp_activation) == (
        True, True, True, "gelu_tanh")
    assert (cfg.sliding_window, cfg.query_pre_attn_scalar) == (WINDOW, 24)
    assert cfg.tie_embeddings == (family == "gemma3_tied")
    if family.startswith("gemma3"):
        assert (cfg.sliding_window_pattern, cfg.qk_norm, cfg.rope_local_theta) == (3, True, 10_000.0)
        assert (cfg.rope_scaling_type, cfg.rope_scaling_factor, cfg.rope_theta) == ("linear", 8.0, 1_000_000.0)
        assert cfg.attn_logit_softcap is None and cfg.final_logit_softcap is None
    else:
        assert (cfg.sliding_window_pattern, cfg.qk_norm, cfg.attn_logit_softcap, cfg.final_logit_softcap) == (
            2, False, 2.0, 3.0)


def test_logits_match_transformers_past_the_window(gemma):
    family, path, model = gemma
    _, graphdef, params = load_hf_model(path)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (3, 6 * WINDOW)).astype(np.int32)
    ours = np.asarray(forward(graphdef, params, jnp.asarray(tokens), jnp.ones(tokens.shape, bool)))
    ref = hf_logits(model, tokens)
    diff = float(np.abs(ours - ref).max())
    print(f"{family}: max |logit diff| = {diff:.2e} (logits up to {np.abs(ref).max():.2f})")
    assert diff < 1e-4


def test_greedy_generation_matches_transformers_on_sampler_and_engine(gemma):
    """24 greedy tokens after 8-token prompts (32 positions, past the window of 5), from the static
    sampler and from the rollout engine's slot pool; a row that emits EOS is padded after it."""
    family, path, model = gemma
    cfg, graphdef, params = load_hf_model(path)
    tok = load_tokenizer(path, vocab_size=cfg.vocab_size)
    n = 24
    prompts = np.random.default_rng(1).integers(5, VOCAB, (2, 8)).astype(np.int32)
    ref = hf_greedy(model, prompts, n, tok)
    if not cfg.tie_embeddings:
        assert all(len(set(row.tolist())) > 2 for row in ref), ref  # real sequences, not one token repeated

    sample = make_sampler(graphdef, cfg, max_new_tokens=n, greedy=True, stop_ids=tok.eos_ids, pad_id=tok.pad_id)
    ours = np.asarray(sample(params, jnp.asarray(prompts), jnp.ones(prompts.shape, bool),
                             jax.random.PRNGKey(0)).tokens[:, prompts.shape[1]:])
    np.testing.assert_array_equal(ours, ref)

    np.testing.assert_array_equal(engine_greedy(graphdef, cfg, params, prompts, n, tok), ref)


def test_export_then_import_is_bit_exact_and_transformers_reads_it(gemma, tmp_path):
    family, path, model = gemma
    cfg, _, params = load_hf_model(path)
    for base in (path, None):  # from the base's config.json, and inferred from our config alone
        out = tmp_path / ("with_base" if base else "inferred")
        save_hf_model(out, cfg, params, tokenizer=load_tokenizer(path), base=base)
        written = json.loads((out / "config.json").read_text())
        assert written["model_type"] == MODEL_TYPE[family]
        cfg2, _, params2 = load_hf_model(out)
        assert cfg2 == dataclasses.replace(cfg, hf_path=str(out))
        for (p, a), (q, b) in zip(flat_params(params), flat_params(params2)):
            assert p == q
            np.testing.assert_array_equal(a, b, err_msg=str(p))
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                                     local_files_only=True).eval()
        assert type(reloaded) is type(model)
        tokens = np.random.default_rng(2).integers(0, VOCAB, (2, 4 * WINDOW)).astype(np.int32)
        np.testing.assert_array_equal(hf_logits(reloaded, tokens), hf_logits(model, tokens))


def test_chat_template_puts_the_system_message_in_the_first_user_turn(gemma):
    """Gemma's template has no system role: as Gemma's own, the system text opens the first user turn."""
    _, path, _ = gemma
    tok = load_tokenizer(path)
    assert tok.eos_id == tok.hf.convert_tokens_to_ids("<end_of_turn>")
    text = tok.chat_prompt("Hi", system="Be brief.")
    assert text == "<s><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(text)
    assert ids[:2] == [tok.bos_id, tok.hf.convert_tokens_to_ids("<start_of_turn>")]  # one id per special token
