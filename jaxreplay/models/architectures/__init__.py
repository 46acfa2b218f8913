"""The published config.json of each model size the shipped configs name (architecture only,
no weights), so `jaxreplay compile` sizes a run without a model directory.

The published config.json of the Hugging Face repositories Qwen/Qwen2.5-0.5B,
Qwen/Qwen2.5-1.5B, Qwen/Qwen2.5-3B, Qwen/Qwen2.5-7B, Qwen/Qwen3-0.6B, Qwen/Qwen3-30B-A3B (a mixture of
experts: 128, top 8) and google/gemma-3-1b-it, and the
`text_config` of google/gemma-3-4b-it written as the gemma3_text model it holds (tests/test_compile.py
checks that they give the published parameter counts); `models.hf.read_model_config` reads them like
any model directory's. This module imports no JAX: `config.validate` runs its check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from jaxreplay.config import Config, ConfigError, owner_check

_HERE = Path(__file__).resolve().parent

SHIPPED = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen3-0.6b", "qwen3-30b-a3b", "gemma3-1b",
           "gemma3-4b")


def architecture_dir(name_or_path: str) -> Optional[Path]:
    """The directory holding the config.json of a shipped architecture name or of a path; None if neither."""
    if name_or_path in SHIPPED:
        return _HERE / name_or_path
    path = Path(name_or_path)
    return path if (path / "config.json").is_file() else None


@owner_check
def validate_hf_config(c: Config) -> None:
    """`model.hf_config`'s part of `config.validate`: a shipped name or a directory with a config.json."""
    name = c.model.hf_config
    if name is not None and architecture_dir(name) is None:
        raise ConfigError(f"model.hf_config: {name!r} is neither a directory with a config.json nor a shipped "
                          f"architecture ({', '.join(SHIPPED)})")
