"""The published config.json of each model size the shipped configs name (architecture only,
no weights), so `jaxreplay compile` sizes a run without a model directory.

Copied from the Hugging Face repositories Qwen/Qwen2.5-0.5B, Qwen/Qwen2.5-1.5B,
Qwen/Qwen2.5-7B and Qwen/Qwen3-0.6B; `models.hf.read_model_config` reads them like any
model directory's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

_HERE = Path(__file__).resolve().parent

SHIPPED = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen3-0.6b")


def architecture_dir(name_or_path: str) -> Optional[Path]:
    """The directory holding the config.json of a shipped architecture name or of a path; None if neither."""
    if name_or_path in SHIPPED:
        return _HERE / name_or_path
    path = Path(name_or_path)
    return path if (path / "config.json").is_file() else None
