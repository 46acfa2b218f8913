"""Weights & Biases tracking (the `wandb` config section): the scalars and histograms TensorBoard
gets, the config and the summary, logged to one W&B run per run dir.

The run's id is kept in RUN_DIR/wandb.json (on the run dir's local side, which a bucket run dir
uploads at each checkpoint), so a resume continues the same W&B run (`resume="allow"`). A resume
from step k logs from step k + 1 on, as metrics.jsonl and TensorBoard do: W&B's history holds each
step once. A fresh start (no checkpoint) begins a new W&B run, as it drops the earlier attempt's rows.
wandb is imported only when `wandb.mode` is not "disabled"; only the leader (process 0) records.
"""

from __future__ import annotations

import json
import os
import secrets
import string
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import numpy as np

TRACKING_FILE = "wandb.json"
INIT_TIMEOUT_S = 120.0  # wandb.init waits on its service process (and online, on the server)


class Tracker:
    """One invocation's handle on the run's W&B run; `open` returns None when tracking is off."""

    def __init__(self, run: Any, first_step: int):
        self._run, self._first_step = run, first_step

    @classmethod
    def open(cls, run_dir: Any, config: Any, resume_step: Optional[int],
             log: Callable[[str], None] = print) -> Optional["Tracker"]:
        """`run_dir`: the run dir (a `rundir.RunDir` or a path); `config`: the resolved Config;
        `resume_step`: the checkpoint step resumed from, None for a fresh start."""
        w = config.wandb
        if w.mode == "disabled":
            return None
        import wandb

        from jaxreplay.config import to_dict

        if resume_step is not None and hasattr(run_dir, "pull"):  # a bucket run dir's mirror starts empty
            run_dir.pull(TRACKING_FILE)
        local = Path(os.fspath(run_dir))
        run_id = (_kept_id(local) if resume_step is not None else None) or _new_id()
        _write_atomic(local / TRACKING_FILE, json.dumps({"id": run_id}) + "\n")
        run = wandb.init(mode=w.mode, project=w.project, entity=w.entity, name=w.name or local.name,
                         id=run_id, resume="allow", dir=str(local), config=to_dict(config),
                         settings=wandb.Settings(init_timeout=INIT_TIMEOUT_S, console="off", silent=True))
        log(f"wandb: {w.mode} run {run_id}" + ("" if resume_step is None else f", resumed from step {resume_step}")
            + (f" in {local / 'wandb'} (wandb sync it later)" if w.mode == "offline" else ""))
        return cls(run, 0 if resume_step is None else resume_step + 1)

    def write(self, record: Mapping[str, Any], histograms: Mapping[str, tuple[int, ...]]) -> None:
        """One step's JSON record (`step` and metrics); `histograms`: the keys holding bin counts, with their edges."""
        step = record["step"]
        if step < self._first_step:  # recorded before the checkpoint resumed from
            return
        data: dict[str, Any] = {}
        for key, value in record.items():
            if key in histograms and isinstance(value, list):
                if sum(value):
                    data[key] = _histogram(value, histograms[key])
            elif key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                data[key] = value
        self._run.log(data, step=step)

    def update_config(self, config: Any) -> None:
        from jaxreplay.config import to_dict

        self._run.config.update(to_dict(config), allow_val_change=True)

    def summary(self, summary: Mapping[str, Any]) -> None:
        self._run.summary.update(dict(summary))

    def close(self) -> None:
        """Ends the W&B run and waits for W&B's service process to write it out: a bucket run
        dir uploads its mirror next, and a test reads the offline files."""
        import wandb

        self._run.finish()
        wandb.teardown()


def _kept_id(local: Path) -> Optional[str]:
    try:
        kept = json.loads((local / TRACKING_FILE).read_text())
    except (OSError, ValueError):
        return None
    return kept.get("id") if isinstance(kept, dict) and isinstance(kept.get("id"), str) else None


def _new_id() -> str:
    """A W&B run id as W&B makes them: 8 lower-case letters and digits."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _histogram(counts: list[int], edges: tuple[int, ...]) -> Any:
    """Bin counts of integers over [edges[i], edges[i+1]) (the last bin drawn as wide again), with
    the bin ends half-way between integers, as TensorBoard shows them (metrics.py)."""
    import wandb

    bins = np.array([edges[0], *edges[1:], 2 * edges[-1]], np.float64) - 0.5
    return wandb.Histogram(np_histogram=(np.asarray(counts, np.float64), bins))
