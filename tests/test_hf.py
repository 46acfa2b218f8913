"""The Hugging Face bridge, against transformers' own Llama, Qwen2 and Qwen3 models.

Each family is a tiny random model made by transformers itself (every weight
perturbed, so biases and norm scales are not their zero/one init), saved with its
own `save_pretrained`, with a small character-level tokenizer beside it.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

torch = pytest.importorskip("torch", reason="the 'parity' extra (CPU torch) is not installed")
pytestmark = pytest.mark.needs_torch

from jaxreplay.compat import value_of
from jaxreplay.models.errors import HFModelError
from jaxreplay.models.hf import load_hf_model, read_model_config, save_hf_model
from jaxreplay.models.tokenizer import load_tokenizer
from jaxreplay.models.transformer import forward
from jaxreplay.rollout.sampling import make_sampler
from conftest import cpu_devices_env
from tiny_hf import save_random_hf_model

# Qwen2 and Qwen3 tie their embeddings as Qwen2.5-0.5B and Qwen3-0.6B do; Llama does not.
# Qwen3's head_dim is not hidden/heads, as in the real Qwen3 models.
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(hidden_size=64, rms_norm_eps=1e-5, rope_theta=500_000.0,
                                             tie_word_embeddings=False)),
    "qwen2": (transformers.Qwen2Config, dict(hidden_size=64, rope_theta=1_000_000.0, tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, dict(hidden_size=48, head_dim=16, rope_theta=1_000_000.0,
                                             tie_word_embeddings=True)),
    # Llama 3.1+ RoPE scaling; with head_dim 16 the wavelengths fall in all three of its regimes.
    "llama3.1": (transformers.LlamaConfig, dict(
        hidden_size=64, rope_theta=500_000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
}
VOCAB = 128


def write_tokenizer(path: Path) -> None:
    """A character-level tokenizer (101 ids) with a ChatML template, EOS = <|im_end|>."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    words = ["<pad>", "<s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(32, 127)] + ["\n"]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"])
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(str(path))


def make_hf_model(family: str, path: Path, seed: int = 0, **overrides):
    """A random fp32 model of `family` saved at `path` with a tokenizer; returns the torch model."""
    config_cls, kwargs = FAMILIES[family]
    shape = dict(vocab_size=VOCAB, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1)
    config = config_cls(eos_token_id=4, pad_token_id=0, bos_token_id=1, **{**shape, **kwargs, **overrides})
    model = save_random_hf_model(config, path, seed)
    write_tokenizer(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 2], "pad_token_id": 0}))
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, make_hf_model(request.param, path)


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.numpy()


def flat(params) -> dict:
    return {p: np.asarray(value_of(v)) for p, v in nnx.to_flat_state(params)}


def assert_bit_equal(a, b) -> None:
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    for p in fa:
        assert fa[p].dtype == fb[p].dtype, p
        np.testing.assert_array_equal(fa[p], fb[p], err_msg=str(p))


# ----------------------------------------------------------------------------------
# Parity


def test_logits_match_transformers(hf_model):
    family, path, model = hf_model
    cfg, graphdef, params = load_hf_model(path)
    assert (cfg.attention_bias, cfg.qk_norm) == {"llama": (False, False), "qwen2": (True, False),
                                                 "qwen3": (False, True), "llama3.1": (False, False)}[family]
    assert cfg.rope_scaling_factor == (8.0 if family == "llama3.1" else 1.0)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (3, 24)).astype(np.int32)
    ours = np.asarray(forward(graphdef, params, jnp.asarray(tokens), jnp.ones(tokens.shape, bool)))
    ref = hf_logits(model, tokens)
    diff = float(np.abs(ours - ref).max())
    print(f"{family}: max |logit diff| = {diff:.2e} (logits up to {np.abs(ref).max():.2f})")
    assert diff < 1e-4


def test_greedy_generation_matches_transformers(hf_model):
    """32 greedy tokens from random prompts; a row that emits EOS is padded after it, as HF pads."""
    family, path, model = hf_model
    cfg, graphdef, params = load_hf_model(path)
    tok = load_tokenizer(path, vocab_size=cfg.vocab_size)
    prompts = np.random.default_rng(0).integers(5, VOCAB, (2, 12)).astype(np.int32)
    sample = make_sampler(graphdef, cfg, max_new_tokens=32, greedy=True, stop_ids=tok.eos_ids,
                          pad_id=tok.pad_id)
    ours = np.asarray(sample(params, jnp.asarray(prompts), jnp.ones(prompts.shape, bool),
                             jax.random.PRNGKey(0)).tokens[:, prompts.shape[1]:])
    with torch.no_grad():
        out = model.generate(torch.from_numpy(prompts).long(), attention_mask=torch.ones(prompts.shape, dtype=torch.long),
                             max_new_tokens=32, do_sample=False, eos_token_id=list(tok.eos_ids),
                             pad_token_id=tok.pad_id)
    ref = out[:, prompts.shape[1]:].numpy()
    ref = np.pad(ref, ((0, 0), (0, 32 - ref.shape[1])), constant_values=tok.pad_id)  # HF stops once all rows end
    np.testing.assert_array_equal(ours, ref)
    assert all(len(set(row.tolist())) > 2 for row in ours)  # real sequences, not one token repeated


# ----------------------------------------------------------------------------------
# Export


def test_export_then_import_is_bit_exact(hf_model, tmp_path):
    _, path, _ = hf_model
    cfg, _, params = load_hf_model(path)
    save_hf_model(tmp_path / "out", cfg, params, tokenizer=load_tokenizer(path), base=path)
    cfg2, _, params2 = load_hf_model(tmp_path / "out")
    assert cfg2 == dataclasses.replace(cfg, hf_path=str(tmp_path / "out"))
    assert_bit_equal(params2, params)


def test_bfloat16_export_then_import_is_bit_exact(tmp_path):
    make_hf_model("qwen3", tmp_path / "src")
    cfg, _, params = load_hf_model(tmp_path / "src", param_dtype="bfloat16")
    save_hf_model(tmp_path / "out", cfg, params)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    _, _, params2 = load_hf_model(tmp_path / "out", param_dtype="bfloat16")
    assert_bit_equal(params2, params)
    assert flat(params2)[("embed", "embedding")].dtype == jnp.bfloat16


def test_transformers_loads_the_export_with_the_same_logits(hf_model, tmp_path):
    family, path, model = hf_model
    cfg, _, params = load_hf_model(path)
    # Small shards: the export is split, with an index, and transformers follows it.
    out = save_hf_model(tmp_path / "out", cfg, params, tokenizer=load_tokenizer(path), base=path,
                        max_shard_bytes=40_000)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                                 local_files_only=True).eval()
    assert type(reloaded) is type(model)
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 16)).astype(np.int32)
    np.testing.assert_array_equal(hf_logits(reloaded, tokens), hf_logits(model, tokens))
    assert load_tokenizer(out).encode("12+35") == load_tokenizer(path).encode("12+35")
    assert load_tokenizer(out).eos_ids == (4, 2)  # generation_config.json came along


def test_export_without_a_base_infers_the_architecture(tmp_path):
    make_hf_model("qwen2", tmp_path / "src")
    cfg, _, params = load_hf_model(tmp_path / "src")
    save_hf_model(tmp_path / "out", cfg, params, tokenizer=load_tokenizer(tmp_path / "src"))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == "qwen2" and written["architectures"] == ["Qwen2ForCausalLM"]
    assert written["eos_token_id"] == [4, 2]  # every stop id, with no generation_config.json to hold them
    assert load_tokenizer(tmp_path / "out").eos_ids == (4, 2)
    assert read_model_config(tmp_path / "out") == dataclasses.replace(cfg, hf_path=str(tmp_path / "out"))


def test_reexport_and_mixed_directories_load_as_transformers_loads_them(tmp_path):
    """Exports of different weights into one directory, one file then sharded and back: after
    each, transformers and the loader read the same (latest) weights; and in a directory that
    holds both layouts, both read model.safetensors."""
    make_hf_model("llama", tmp_path / "src")
    cfg, _, params = load_hf_model(tmp_path / "src")
    other = jax.tree.map(lambda x: x * 1.5, params)
    tokens = np.random.default_rng(3).integers(0, VOCAB, (2, 12)).astype(np.int32)

    def agree(path: Path, want) -> None:
        _, graphdef, loaded = load_hf_model(path)
        assert_bit_equal(loaded, want)
        ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                                local_files_only=True).eval()
        ours = np.asarray(forward(graphdef, loaded, jnp.asarray(tokens), jnp.ones(tokens.shape, bool)))
        assert np.abs(hf_logits(ref, tokens) - ours).max() < 1e-4

    out = tmp_path / "out"
    for weights, shard in [(params, 40_000), (other, 1 << 30), (params, 40_000)]:
        save_hf_model(out, cfg, weights, base=tmp_path / "src", max_shard_bytes=shard)
        agree(out, weights)

    mixed = save_hf_model(tmp_path / "mixed", cfg, other, base=tmp_path / "src")
    for f in out.glob("model*"):  # the sharded export of `params` beside a single file of `other`
        f.rename(mixed / f.name)
    agree(mixed, other)


# ----------------------------------------------------------------------------------
# Sharded checkpoints and sharded placement


def test_sharded_checkpoint_with_index_loads_like_a_single_file(tmp_path):
    model = make_hf_model("llama", tmp_path / "single")
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="50KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    _, _, single = load_hf_model(tmp_path / "single")
    _, _, sharded = load_hf_model(tmp_path / "sharded")
    assert_bit_equal(sharded, single)


def test_loads_straight_into_a_device_mesh(tmp_path):
    """On 4 CPU devices (a fresh process): every parameter arrives with the sharding asked
    for, each device holding its own slice of the checkpoint's tensor."""
    make_hf_model("qwen3", tmp_path)
    script = textwrap.dedent(f"""
        import jax, numpy as np
        from flax import nnx
        from jax.sharding import Mesh
        from jaxreplay.compat import value_of
        from jaxreplay.models.transformer import abstract_params
        from jaxreplay.models.hf import load_hf_model, read_model_config
        from jaxreplay.models.sharding import param_shardings

        path = {str(tmp_path)!r}
        mesh = Mesh(np.array(jax.devices()).reshape(1, 2, 2), ("data", "fsdp", "tensor"))
        shardings = param_shardings(mesh, abstract_params(read_model_config(path)))
        _, _, sharded = load_hf_model(path, shardings=lambda abstract: param_shardings(mesh, abstract))
        _, _, plain = load_hf_model(path)
        want = dict(nnx.to_flat_state(shardings))
        split = 0
        for p, v in nnx.to_flat_state(sharded):
            assert value_of(v).sharding == value_of(want[p]), (p, value_of(v).sharding, value_of(want[p]))
            np.testing.assert_array_equal(np.asarray(value_of(v)), np.asarray(value_of(dict(nnx.to_flat_state(plain))[p])))
            for shard in value_of(v).addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(value_of(v))[shard.index])
            split += len({{str(s.index) for s in value_of(v).addressable_shards}}) > 1
        assert split > 0
        print("ok", split)
    """)
    done = subprocess.run([sys.executable, "-c", script], env=cpu_devices_env(4), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok")


# ----------------------------------------------------------------------------------
# Bad directories: one-line errors naming what is wrong


def test_missing_tensor_is_named(tmp_path):
    make_hf_model("qwen2", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFModelError, match=r"missing tensor model\.layers\.1\.self_attn\.k_proj\.bias$"):
        load_hf_model(tmp_path)


def test_untied_model_without_lm_head_is_a_missing_tensor(tmp_path):
    make_hf_model("qwen2", tmp_path, tie_word_embeddings=False)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFModelError, match=r"missing tensor lm_head\.weight"):
        load_hf_model(tmp_path)


def test_misshaped_tensor_is_named_with_both_shapes(tmp_path):
    make_hf_model("llama", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"] = np.zeros((64, 95), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFModelError, match=r"tensor model\.layers\.0\.mlp\.down_proj\.weight has shape \[64, 95\], "
                                           r"the config implies \[64, 96\]"):
        load_hf_model(tmp_path)


def test_unknown_architecture_is_named(tmp_path):
    make_hf_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(HFModelError, match=r"unknown architecture model_type='gpt2' "
                                           r"\(supported: gemma2, gemma3_text, llama, qwen2, qwen3"):
        load_hf_model(tmp_path)


@pytest.mark.parametrize("overrides, match", [
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type='linear'"),
    (dict(attention_bias=True), "attention_bias=true"),
    (dict(mlp_bias=True), "mlp_bias=true"),
])
def test_features_the_decoder_lacks_are_refused(tmp_path, overrides, match):
    make_hf_model("llama", tmp_path, **overrides)
    with pytest.raises(HFModelError, match=match):
        load_hf_model(tmp_path)


def test_tokenizer_larger_than_the_embedding_is_refused(tmp_path):
    make_hf_model("qwen3", tmp_path, vocab_size=96)  # the tokenizer has 101 ids
    cfg = read_model_config(tmp_path)
    with pytest.raises(HFModelError, match=r"has 101 tokens but the model's embedding has only 96 rows"):
        load_tokenizer(tmp_path, vocab_size=cfg.vocab_size)


def test_directory_without_config_or_safetensors(tmp_path):
    with pytest.raises(HFModelError, match="no config.json"):
        load_hf_model(tmp_path)
    make_hf_model("llama", tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(HFModelError, match=r"holds no safetensors weights \(found pytorch_model\.bin"):
        load_hf_model(tmp_path)


def test_index_naming_a_missing_shard(tmp_path):
    make_hf_model("llama", tmp_path).save_pretrained(str(tmp_path / "sharded"), max_shard_size="50KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    lost = index["weight_map"]["model.norm.weight"]
    (tmp_path / "sharded" / lost).unlink()
    with pytest.raises(HFModelError, match=rf"names {lost}, which does not exist"):
        load_hf_model(tmp_path / "sharded")


# ----------------------------------------------------------------------------------
# Tokenizer


def test_tokenizer_chat_template_and_stop_ids(hf_model):
    _, path, _ = hf_model
    tok = load_tokenizer(path)
    assert tok.chat_prompt("hi", system="be brief") == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert (tok.eos_id, tok.eos_ids, tok.pad_id, tok.vocab_size) == (4, (4, 2), 0, 101)
    ids = tok.encode("7*6=42")
    assert tok.decode(ids + [2] + tok.encode("junk")) == "7*6=42"  # any stop id ends the text
    assert tok.encode_prompt("hi", chat=True)[0] == 3  # <|im_start|> is one special token


# ----------------------------------------------------------------------------------
# The training loop on an imported model


@pytest.mark.slow
def test_training_starts_from_the_hf_weights(tmp_path):
    """model.hf_path: the loop trains the imported weights (no warm start) with the HF tokenizer's
    chat template, and `jaxreplay export` writes its checkpoint as a directory transformers loads."""
    from jaxreplay.cli import main
    from jaxreplay.config import load_config
    from jaxreplay.train.checkpoint import restore_policy_params
    from jaxreplay.train.driver import train

    model = make_hf_model("qwen3", tmp_path / "hf")
    tok = load_tokenizer(tmp_path / "hf")

    def likely_answer(prompt: str) -> str:  # the HF model's own greedy first token: rewards that vary
        logits = hf_logits(model, np.array([tok.encode_prompt(prompt, chat=True)]))
        return tok.decode([int(logits[0, -1].argmax())])

    for split, n in [("train", 40), ("test", 4)]:
        (tmp_path / f"{split}.jsonl").write_text("".join(
            json.dumps({"prompt": f"{i}+{i}=", "answer": likely_answer(f"{i}+{i}=")}) + "\n" for i in range(n)))
    c = load_config(None, [
        f"model.hf_path={tmp_path / 'hf'}", "model.max_seq_len=40", "task.name=jsonl",
        f"task.path={tmp_path}/{{split}}.jsonl", "task.reward=exact_match", "task.chat_template=true",
        "task.max_prompt_len=32", "warmstart.steps=0", "sampling.max_new_tokens=1", "sampling.temperature=0.3",
        "train.batch_size=16",
        "train.prompts_per_step=4", "train.group_size=4", "train.steps=2", "train.eval_every=2",
        "train.learning_rate=1e-4", "train.warmup_steps=0", "replay.max_size=64", "replay.min_size_to_sample=16",
        "checkpoint.every=2", "run.progress_bar=false", f"run.dir={tmp_path / 'run'}",
    ])
    lines = []
    assert train(c, log=lines.append)["steps"] == 2
    assert any(line.startswith(f"loaded {tmp_path / 'hf'}") for line in lines)

    cfg, graphdef, imported = load_hf_model(tmp_path / "hf")
    trained, _ = restore_policy_params(tmp_path / "run" / "checkpoints", imported)
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(imported)))
    assert 0 < moved < 1e-2  # two small Adam steps away from the HF weights, not from a fresh init

    run = tmp_path / "run"
    before = {f.name: f.read_bytes() for f in (tmp_path / "hf").iterdir()}
    assert main(["export", str(run / "config.yaml"), "--checkpoint", str(run), "--out", str(tmp_path / "hf")]) == 2
    assert {f.name: f.read_bytes() for f in (tmp_path / "hf").iterdir()} == before  # refused before writing
    assert main(["export", str(run / "config.yaml"), "--checkpoint", str(run), "--out", str(tmp_path / "out")]) == 0
    assert load_tokenizer(tmp_path / "out").eos_ids == tok.eos_ids
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    tokens = np.random.default_rng(2).integers(0, VOCAB, (1, 10)).astype(np.int32)
    ours = np.asarray(forward(graphdef, trained, jnp.asarray(tokens), jnp.ones(tokens.shape, bool)))
    assert np.abs(hf_logits(reloaded, tokens) - ours).max() < 1e-4
