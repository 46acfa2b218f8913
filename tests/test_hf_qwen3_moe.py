"""Qwen3-MoE against transformers' own Qwen3MoeForCausalLM: logits, HF's load-balancing loss,
greedy decoding on the static sampler and on the rollout engine, and the bridge both ways.

The model is tiny and random, made by transformers itself with every weight perturbed (its router
starts at zero): four layers, of which layer 1 is dense (`mlp_only_layers`) and the others hold 8
experts with top-2 routing, `norm_topk_prob` on; a second checkpoint has `decoder_sparse_step` 2
and `norm_topk_prob` off, so both of HF's layer rules and both weightings show in the logits.
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
from jaxreplay.models.moe import load_balancing_loss, sparse_layers  # noqa: E402
from jaxreplay.models.tokenizer import load_tokenizer  # noqa: E402
from jaxreplay.models.transformer import forward, routed_score_hidden  # noqa: E402
from jaxreplay.rollout.sampling import make_sampler  # noqa: E402
from tiny_hf import (QWEN_TOOLS, engine_greedy, flat_params, hf_greedy, hf_logits,  # noqa: E402
                     save_random_hf_model, write_char_tokenizer)

VOCAB = 128
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
             initializer_range=0.1, num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
             output_router_logits=True, router_aux_loss_coef=0.01, eos_token_id=4, pad_token_id=0, bos_token_id=1)
VARIANTS = {
    "dense_layer_1": dict(mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True),
    "every_second": dict(mlp_only_layers=[], decoder_sparse_step=2, norm_topk_prob=False),
}
SPARSE = {"dense_layer_1": (0, 2, 3), "every_second": (1, 3)}


def make_qwen3_moe(variant: str, path: Path, seed: int = 0):
    config = transformers.Qwen3MoeConfig(**SHAPE, **VARIANTS[variant])
    model = save_random_hf_model(config, path, seed)
    write_char_tokenizer(path, QWEN_TOOLS)
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def qwen3_moe(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, make_qwen3_moe(request.param, path)


def test_config_json_becomes_the_experts_and_their_layers(qwen3_moe):
    variant, path, _ = qwen3_moe
    cfg = read_model_config(path)
    assert (cfg.n_experts, cfg.experts_per_token, cfg.moe_d_ff, cfg.d_ff, cfg.qk_norm) == (8, 2, 32, 96, True)
    assert cfg.moe_norm_topk == VARIANTS[variant]["norm_topk_prob"]
    assert cfg.router_aux_loss_coef == 0.01  # output_router_logits turns HF's own aux loss on
    assert sparse_layers(cfg) == SPARSE[variant]


def test_logits_and_load_balancing_loss_match_transformers(qwen3_moe):
    variant, path, model = qwen3_moe
    _, graphdef, params = load_hf_model(path)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (3, 20)).astype(np.int32)
    mask = np.ones(tokens.shape, bool)
    mask[0, :6] = False  # a left-padded row: padding counts in neither loss
    ours = np.asarray(forward(graphdef, params, jnp.asarray(tokens), jnp.ones(tokens.shape, bool)))
    ref = hf_logits(model, tokens)
    diff = float(np.abs(ours - ref).max())
    print(f"{variant}: max |logit diff| = {diff:.2e} (logits up to {np.abs(ref).max():.2f})")
    assert diff < 1e-4

    with torch.no_grad():
        out = model(torch.from_numpy(tokens).long(), attention_mask=torch.from_numpy(mask).long(),
                    output_router_logits=True)
    _, _, routing = routed_score_hidden(graphdef, params, jnp.asarray(tokens), jnp.asarray(mask))
    aux = float(load_balancing_loss(routing.logits, jnp.asarray(mask), 2))
    assert aux == pytest.approx(float(out.aux_loss), rel=1e-5)


def test_greedy_generation_matches_transformers_on_sampler_and_engine(qwen3_moe):
    """16 greedy tokens after 8-token prompts from the static sampler; from the rollout engine's slot
    pool too on one checkpoint (its compile is most of the test's time)."""
    variant, path, model = qwen3_moe
    cfg, graphdef, params = load_hf_model(path)
    tok = load_tokenizer(path, vocab_size=cfg.vocab_size)
    n = 16
    prompts = np.random.default_rng(1).integers(5, VOCAB, (2, 8)).astype(np.int32)
    ref = hf_greedy(model, prompts, n, tok)
    assert any(len(set(row.tolist())) > 2 for row in ref), ref  # a real sequence, not one token repeated
    sample = make_sampler(graphdef, cfg, max_new_tokens=n, greedy=True, stop_ids=tok.eos_ids, pad_id=tok.pad_id)
    ours = np.asarray(sample(params, jnp.asarray(prompts), jnp.ones(prompts.shape, bool),
                             jax.random.PRNGKey(0)).tokens[:, prompts.shape[1]:])
    np.testing.assert_array_equal(ours, ref)
    if variant == "dense_layer_1":
        np.testing.assert_array_equal(engine_greedy(graphdef, cfg, params, prompts, n, tok), ref)


def test_export_then_import_is_bit_exact_and_transformers_reads_it(qwen3_moe, tmp_path):
    variant, path, model = qwen3_moe
    cfg, _, params = load_hf_model(path)
    for base in (path, None):  # from the base's config.json, and inferred from our config alone
        out = tmp_path / ("with_base" if base else "inferred")
        save_hf_model(out, cfg, params, tokenizer=load_tokenizer(path), base=base)
        written = json.loads((out / "config.json").read_text())
        assert written["model_type"] == "qwen3_moe"
        assert written["mlp_only_layers"] == VARIANTS[variant]["mlp_only_layers"]
        cfg2, _, params2 = load_hf_model(out)
        assert cfg2 == dataclasses.replace(cfg, hf_path=str(out))
        for (p, a), (q, b) in zip(flat_params(params), flat_params(params2)):
            assert p == q
            np.testing.assert_array_equal(a, b, err_msg=str(p))
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                                     local_files_only=True).eval()
        assert type(reloaded) is type(model)
        tokens = np.random.default_rng(2).integers(0, VOCAB, (2, 12)).astype(np.int32)
        np.testing.assert_array_equal(hf_logits(reloaded, tokens), hf_logits(model, tokens))


def test_chat_template_is_qwen3_s(qwen3_moe):
    _, path, _ = qwen3_moe
    tok = load_tokenizer(path)
    assert tok.eos_id == tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.chat_prompt("Hi", system="Be brief.") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
