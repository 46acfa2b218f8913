"""`jaxreplay export`: a training checkpoint's policy as a Hugging Face model directory.

The run's config says what the policy is: with `model.hf_path`, the export keeps that
directory's config.json keys, generation_config.json and tokenizer, so the result is
the released model with trained weights. A policy trained from scratch is written
with the HF architecture that holds its features (Llama, Qwen2 or Qwen3) and no
tokenizer (the embedded tasks' tokenizers are not Hugging Face ones).

A LoRA policy (`model.lora`) is written twice: merged (each adapter folded into its
kernel, W + (alpha / r) A B) as the HF model in `out`, which transformers loads alone; and
its adapters in PEFT's format in `out/adapter` (adapter_config.json,
adapter_model.safetensors), which `peft` loads onto the base. The adapters go into a
folder of their own: transformers (where peft is installed) loads an adapter_config.json it
finds beside config.json on top of that directory's weights, applying them twice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from jaxreplay.config import Config, DType

# The folder under the export that holds a LoRA policy's adapters in PEFT's format
ADAPTER_DIR = "adapter"


def export_checkpoint(config: Config, checkpoint: str | Path, out: str | Path, *, step: Optional[int] = None,
                      dtype: Optional[DType] = None) -> Path:
    """Writes the policy of `checkpoint` (a run directory or its checkpoints/) at `step`
    (default: the latest) to `out`; `dtype` casts the saved weights. Returns `out`. A LoRA
    policy's adapters also go to `out/adapter` in PEFT's format; any other policy's export removes
    the adapter files an earlier export left there."""
    from jaxreplay.models import lora
    from jaxreplay.models.hf import remove_peft_adapters, save_hf_model, save_peft_adapters
    from jaxreplay.models.tokenizer import load_tokenizer
    from jaxreplay.train.eval import load_policy

    cfg, _, params, _, _ = load_policy(config, checkpoint=str(checkpoint), step=step)
    tokenizer = load_tokenizer(cfg.hf_path) if cfg.hf_path else None
    if not lora.enabled(cfg):
        save_hf_model(out, cfg, params, tokenizer=tokenizer, base=cfg.hf_path, dtype=dtype)
        remove_peft_adapters(Path(out) / ADAPTER_DIR)
        return Path(out)
    merged = lora.merge_adapters(params, cfg)
    save_hf_model(out, lora.base_model_config(cfg), merged, tokenizer=tokenizer, base=cfg.hf_path, dtype=dtype)
    save_peft_adapters(Path(out) / ADAPTER_DIR, cfg, params, base=cfg.hf_path, dtype=dtype)
    return Path(out)
