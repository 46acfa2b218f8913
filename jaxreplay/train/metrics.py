"""Run metrics: one JSON object per learner step in metrics.jsonl, TensorBoard (and W&B) beside it."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from jaxreplay.train.accounting import HISTOGRAMS


def _plain(value: Any) -> Any:
    """JSON-safe scalars; non-finite floats become null rather than invalid JSON."""
    if isinstance(value, (np.generic, np.ndarray)):
        value = value.item()
    if hasattr(value, "item") and callable(value.item):  # jax scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _summary_writer_class() -> type:
    """tensorboardX's SummaryWriter, imported without torch. tensorboardX imports torch
    whenever it is installed (as on GPU images and Colab), only to accept torch tensors,
    which we never pass: 3 s of every run's start-up on a CPU host. Where torch is already
    imported, nothing changes."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX expects
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class MetricsWriter:
    """Appends to metrics.jsonl and writes TensorBoard events; with a `tracker` (tracking.Tracker),
    logs the same scalars and histograms to W&B.

    `purge_step`: TensorBoard hides the events of earlier writers at this step and later,
    so a resumed run (which drops those rows from metrics.jsonl: recorder.py) shows each
    step once. Each writer gets its own event file: tensorboardX names them by the second,
    and a second writer within the same second would overwrite the first's."""

    def __init__(self, run_dir: str | Path, purge_step: Optional[int] = None, tracker: Any = None):
        self.path, self.tracker = Path(run_dir) / METRICS_FILE, tracker
        self._file = open(self.path, "a", buffering=1)
        try:
            SummaryWriter = _summary_writer_class()
            self._tb = SummaryWriter(str(Path(run_dir) / TENSORBOARD_DIR), purge_step=purge_step,
                                     filename_suffix=f".{time.time_ns()}")
        except ImportError:  # TensorBoard is a nicety; metrics.jsonl is the record.
            self._tb = None

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        record = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key in HISTOGRAMS and isinstance(value, list):
                    self._histogram(key, value, HISTOGRAMS[key], step)
                elif key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
        if self.tracker is not None:
            self.tracker.write(record, HISTOGRAMS)
        return record

    def _histogram(self, key: str, counts: list[int], edges: tuple[int, ...], step: int) -> None:
        """Bin counts of integers over [edges[i], edges[i+1]) (the last bin open-ended, drawn
        as wide again) as a TensorBoard histogram; its buckets end half-way between integers."""
        if not sum(counts):
            return
        limits = np.array([*edges[1:], 2 * edges[-1]], np.float64) - 0.5
        lows = np.array(edges, np.float64)
        mids = (lows + limits - 0.5) / 2  # of the integers in each bin
        filled = np.nonzero(counts)[0]
        c = np.asarray(counts, np.float64)
        self._tb.add_histogram_raw(key, min=float(lows[filled[0]]), max=float(limits[filled[-1]]), num=int(c.sum()),
                                   sum=float(c @ mids), sum_squares=float(c @ mids ** 2),
                                   bucket_limits=limits.tolist(), bucket_counts=c.tolist(), global_step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self.tracker is not None:
            self.tracker.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Records of a run, the last one kept when a resumed run rewrote a step. A torn last
    line (a run killed mid-write) is left out."""
    by_step: dict[int, dict[str, Any]] = {}
    path = Path(run_dir) / METRICS_FILE
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                break
            raise
        by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]
