"""Run metrics: one JSON object per learner step in metrics.jsonl, TensorBoard beside it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np


def _plain(value: Any) -> Any:
    """JSON-safe scalars; non-finite floats become null rather than invalid JSON."""
    if isinstance(value, (np.generic, np.ndarray)):
        value = value.item()
    if hasattr(value, "item") and callable(value.item):  # jax scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends to metrics.jsonl (resume-safe) and writes TensorBoard events."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)
        try:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        except ImportError:  # TensorBoard is a nicety; metrics.jsonl is the record.
            self._tb = None

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        record = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
        return record

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Records of a run, the last one kept when a resumed run rewrote a step."""
    by_step: dict[int, dict[str, Any]] = {}
    path = Path(run_dir) / "metrics.jsonl"
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]
