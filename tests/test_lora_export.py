"""The LoRA export (issue 51): the merged model in HF's format, which transformers loads alone, and
the adapters in PEFT's, which `peft` loads onto the HF base; both give the adapted policy's logits.

A tiny Qwen2-shaped base made here, LoRA on every target, and every adapter factor random (B too:
a fresh adapter adds 0, which no export could get wrong). The torch-free checks run on the default
lane against our own loader; transformers' and peft's own models run on the Reverb lane (torch).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxreplay.compat import value_of
from jaxreplay.config import LORA_TARGETS, LoraConfig
from jaxreplay.models import lora
from jaxreplay.models.errors import HFModelError
from jaxreplay.models.hf import PEFT_CONFIG, PEFT_WEIGHTS, load_hf_model, save_hf_model, save_peft_adapters
from jaxreplay.models.transformer import forward, with_adapters
from tiny_hf import write_model

RANK, ALPHA = 4, 8.0


def adapted(base_dir: Path, targets=LORA_TARGETS, seed: int = 1):
    """(cfg, graphdef, params): the base at `base_dir` with adapters on `targets`, every factor random."""
    cfg, _, base = load_hf_model(base_dir)
    cfg = dataclasses.replace(cfg, lora=LoraConfig(targets=tuple(targets), rank=RANK, alpha=ALPHA))
    graphdef, params = with_adapters(cfg, base, seed)
    adapters, base = lora.split_adapters(params)
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    leaves = [0.2 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    return cfg, graphdef, lora.join(jax.tree.unflatten(tree, leaves), base)


def logits(graphdef, params, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(forward(graphdef, params, jnp.asarray(tokens), jnp.ones(tokens.shape, bool)))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("lora_base") / "base", tokenizer=False)


TOKENS = np.random.default_rng(0).integers(0, 128, (2, 12)).astype(np.int32)


def test_the_merged_export_loads_as_the_adapted_model(base_dir, tmp_path):
    """Each adapter folded into its kernel: the HF directory, read back, gives the adapted logits
    (float32, 1e-5), where the base alone is far from them."""
    cfg, graphdef, params = adapted(base_dir)
    out = save_hf_model(tmp_path / "merged", lora.base_model_config(cfg), lora.merge_adapters(params, cfg),
                        base=base_dir)
    merged_cfg, merged_graphdef, merged = load_hf_model(out)
    assert merged_cfg.lora == LoraConfig()  # a plain model: transformers needs nothing of ours
    want = logits(graphdef, params, TOKENS)
    np.testing.assert_allclose(logits(merged_graphdef, merged, TOKENS), want, atol=1e-5, rtol=1e-5)
    _, base_graphdef, base = load_hf_model(base_dir)
    assert np.abs(logits(base_graphdef, base, TOKENS) - want).max() > 1e-2  # the adapters matter


def test_the_peft_files_name_each_factor_as_peft_does(base_dir, tmp_path):
    """adapter_config.json with r, lora_alpha and the HF module names; lora_A [r, in] and lora_B
    [out, r] of each targeted module of each layer, under base_model.model.<HF module path>."""
    targets = ("q_proj", "v_proj", "down_proj")
    cfg, _, params = adapted(base_dir, targets)
    out = save_peft_adapters(tmp_path / "adapter", cfg, params, base=base_dir)
    config = json.loads((out / PEFT_CONFIG).read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == (
        "LORA", "CAUSAL_LM", RANK, ALPHA)
    assert sorted(config["target_modules"]) == sorted(targets)
    assert (config["use_rslora"], config["bias"], config["base_model_name_or_path"]) == (False, "none", str(base_dir))
    tensors = load_file(str(out / PEFT_WEIGHTS))
    d, kv, ff = cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg.d_ff
    prefix = "base_model.model.model.layers.0."
    assert {name: t.shape for name, t in tensors.items()} == {
        prefix + "self_attn.q_proj.lora_A.weight": (RANK, d), prefix + "self_attn.q_proj.lora_B.weight": (d, RANK),
        prefix + "self_attn.v_proj.lora_A.weight": (RANK, d), prefix + "self_attn.v_proj.lora_B.weight": (kv, RANK),
        prefix + "mlp.down_proj.lora_A.weight": (RANK, ff), prefix + "mlp.down_proj.lora_B.weight": (d, RANK)}
    a = dict((tuple(p), value_of(v)) for p, v in nnx.to_flat_state(params))[("layers", 0, "mlp", "down_proj", "lora_a")]
    np.testing.assert_array_equal(tensors[prefix + "mlp.down_proj.lora_A.weight"], np.asarray(a).T)


def test_a_model_without_adapters_has_no_peft_export(base_dir, tmp_path):
    cfg, _, params = load_hf_model(base_dir)
    with pytest.raises(HFModelError, match="no LoRA adapters"):
        save_peft_adapters(tmp_path / "adapter", cfg, params)


@pytest.mark.slow
def test_jaxreplay_export_of_a_lora_run_writes_the_merged_model_and_the_peft_adapters(tmp_path):
    """`jaxreplay export RUN_DIR --out OUT` of a LoRA run on an HF base: OUT is the merged model with the
    base's tokenizer, read back with the logits of the policy the checkpoint holds (its adapters on
    the base); OUT/adapter holds those adapters in PEFT's format, naming the base directory."""
    from jaxreplay.cli import main
    from jaxreplay.config import load_config
    from jaxreplay.models.hf import INDEX_FILE
    from jaxreplay.tools.export import ADAPTER_DIR
    from jaxreplay.train.driver import train
    from jaxreplay.train.eval import load_policy

    hf = write_model(tmp_path / "hf")
    for split, n in [("train", 16), ("test", 4)]:
        (tmp_path / f"{split}.jsonl").write_text("".join(
            json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)[0]}) + "\n" for i in range(n)))
    config = load_config(None, [
        f"model.hf_path={hf}", "model.max_seq_len=40", "task.name=jsonl", f"task.path={tmp_path}/{{split}}.jsonl",
        "task.reward=exact_match", "task.max_prompt_len=32", "warmstart.steps=0", "sampling.max_new_tokens=2",
        "train.batch_size=16", "train.prompts_per_step=4", "train.group_size=4", "train.eval_every=1000",
        "train.learning_rate=1e-2", "train.warmup_steps=0", "train.loss=asymre", "train.advantage=group_centered",
        "replay.max_size=64", "replay.min_size_to_sample=16", "run.progress_bar=false", "train.steps=2",
        f"run.dir={tmp_path / 'run'}", "model.lora.targets=[q_proj,v_proj,down_proj]", f"model.lora.rank={RANK}",
        f"model.lora.alpha={ALPHA}"])
    train(config, log=lambda _: None)

    out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 0
    _, graphdef, policy, _, _ = load_policy(config, checkpoint=str(tmp_path / "run"))
    assert any(np.any(np.asarray(x)) for p, x in jax.tree_util.tree_flatten_with_path(lora.split_adapters(policy)[0])[0]
               if "lora_b" in jax.tree_util.keystr(p))  # trained: the adapters add something to export
    merged_cfg, merged_graphdef, merged = load_hf_model(out)
    assert merged_cfg.lora == LoraConfig() and (out / "tokenizer.json").is_file() and not (out / INDEX_FILE).exists()
    tokens = np.random.default_rng(1).integers(0, 101, (2, 12)).astype(np.int32)
    np.testing.assert_allclose(logits(merged_graphdef, merged, tokens), logits(graphdef, policy, tokens),
                               atol=1e-5, rtol=1e-5)
    adapter = out / ADAPTER_DIR
    config_json = json.loads((adapter / PEFT_CONFIG).read_text())
    assert (config_json["r"], config_json["lora_alpha"], config_json["base_model_name_or_path"]) == (RANK, ALPHA, str(hf))
    assert sorted(config_json["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    assert len(load_file(str(adapter / PEFT_WEIGHTS))) == 2 * 3  # A and B of three modules of the one layer
    assert not (out / PEFT_CONFIG).exists()  # beside config.json, transformers would add the adapters again


# ----------------------------------------------------------------------------------
# transformers and peft themselves (torch: the Reverb lane)


@pytest.mark.needs_torch
def test_transformers_and_peft_load_the_exports_with_the_adapted_logits(base_dir, tmp_path):
    """The merged directory through AutoModelForCausalLM, and the base through AutoModelForCausalLM
    with the adapters through PeftModel.from_pretrained: both give our adapted logits (float32)."""
    import torch
    import transformers

    peft = pytest.importorskip("peft", reason="peft is not installed (the parity extra pins it on the Reverb lane)")

    cfg, graphdef, params = adapted(base_dir)
    merged_dir = save_hf_model(tmp_path / "merged", lora.base_model_config(cfg), lora.merge_adapters(params, cfg),
                               base=base_dir)
    adapter_dir = save_peft_adapters(tmp_path / "adapter", cfg, params, base=base_dir)
    load = lambda path: transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, local_files_only=True).eval()
    with_peft = peft.PeftModel.from_pretrained(load(base_dir), str(adapter_dir)).eval()
    want = logits(graphdef, params, TOKENS)
    for name, model in (("merged", load(merged_dir)), ("peft", with_peft)):
        with torch.no_grad():
            got = model(torch.from_numpy(TOKENS).long()).logits.numpy()
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=name)
    with torch.no_grad():
        base = load(base_dir)(torch.from_numpy(TOKENS).long()).logits.numpy()
    assert np.abs(base - want).max() > 1e-2  # peft applied the adapters, not a fresh B = 0
