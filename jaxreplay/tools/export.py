"""`jaxreplay export`: a training checkpoint's policy as a Hugging Face model directory.

The run's config says what the policy is: with `model.hf_path`, the export keeps that
directory's config.json keys, generation_config.json and tokenizer, so the result is
the released model with trained weights. A policy trained from scratch is written
with the HF architecture that holds its features (Llama, Qwen2 or Qwen3) and no
tokenizer (the embedded tasks' tokenizers are not Hugging Face ones).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from jaxreplay.config import Config, DType


def export_checkpoint(config: Config, checkpoint: str | Path, out: str | Path, *, step: Optional[int] = None,
                      dtype: Optional[DType] = None) -> Path:
    """Writes the policy of `checkpoint` (a run directory or its checkpoints/) at `step`
    (default: the latest) to `out`; `dtype` casts the saved weights. Returns `out`."""
    from jaxreplay.models.hf import save_hf_model
    from jaxreplay.models.tokenizer import load_tokenizer
    from jaxreplay.train.eval import load_policy

    cfg, _, params, _, _ = load_policy(config, checkpoint=str(checkpoint), step=step)
    tokenizer = load_tokenizer(cfg.hf_path) if cfg.hf_path else None
    return save_hf_model(out, cfg, params, tokenizer=tokenizer, base=cfg.hf_path, dtype=dtype)
