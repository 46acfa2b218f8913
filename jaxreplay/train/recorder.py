"""The one place that writes a run's records: config.yaml, metrics.jsonl (+ TensorBoard, W&B), summary.json.

The records must say what the run did:
- config.yaml holds exactly the settings the run used (the driver hands over the resolved
  config: the HF architecture, the backend `auto` chose, the calibrated ratio). A resume
  whose config would change the run is refused before anything is written, naming every such
  key (`resume_config`); keys in `MAY_CHANGE_ON_RESUME` may change, and are recorded. A hand
  edit of config.yaml that the checkpoint's record overrules is named in one line and written
  back to what runs: the file is the run's record, not an input (as the saved config of a
  MaxText or Tunix run).
- After a resume from step k, metrics.jsonl and TensorBoard hold each step once: rows past k
  (and a torn last line) are dropped, and TensorBoard hides its events from step k + 1 on.
  A fresh start in a run dir with no checkpoint drops every row of the attempt before it.
Every rewrite is atomic (a temporary file, then `os.replace`): a kill leaves the old file or the new.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import yaml

from jaxreplay import storage, warn as warning
from jaxreplay.config import Config, ConfigError, config_from_raw, flatten, mapping_keys, read_yaml, show, to_dict
from jaxreplay.train.metrics import METRICS_FILE, MetricsWriter
from jaxreplay.train.tracking import Tracker

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"

# Keys (fnmatch patterns) a resume may change, and why: they say how far, how often, how
# visibly or where the run goes on, not what it computes. Every other key (seed, model, task,
# warm start, replay, loss, sampling, ...) changes the run, and a resume with it is refused.
MAY_CHANGE_ON_RESUME: dict[str, str] = {
    "train.steps": "how far to train: raising it trains further",
    "train.eval_every": "when to evaluate the policy; evaluation does not touch training",
    "train.learning_rate": "lowering it is how a run recovers from non-finite updates (guards.NonFiniteError)",
    "train.max_nonfinite_steps": "how many skipped updates in a row stop the run",
    "run.progress_bar": "terminal display only",
    "run.dir": "where the run dir is: a copied or moved run dir resumes",
    "run.lease_s": "how long a bucket run dir's lock outlives its holder",
    "*.timeout_s": "how long to wait on the table or other processes before giving up",
    "replay.port": "the port the table's server binds, afresh in each invocation",
    "checkpoint.every": "when checkpoints are taken",
    "checkpoint.every_seconds": "when checkpoints are taken",
    "checkpoint.keep": "how many checkpoints are kept",
    "mesh.data": "the mesh sizes: the checkpoint is resharded onto the new mesh",
    "mesh.fsdp": "the mesh sizes: the checkpoint is resharded onto the new mesh",
    "mesh.tensor": "the mesh sizes: the checkpoint is resharded onto the new mesh",
    "mesh.topology": "the slice the config is sized for: moving to another slice size is routine",
    "distributed.*": "which processes run it and where they meet: a slice of another size has other ones",
    "train.micro_batch_size": "memory only (gradients summed over the same batch): another slice may need another",
    "train.remat": "memory only (recomputes the same activations): another slice may need another",
    "train.logits_chunk_size": "memory only (the same logits, a chunk at a time): another slice may need another",
    "sampling.prefill_chunk_size": "memory only (the same prefill, a chunk at a time): another slice may need another",
    "warmstart.cache_dir": "where the shared warm start is cached, not what it holds",
    # Not wandb.project or wandb.entity: the W&B run a resume continues (wandb.json's id) lives there.
    "wandb.mode": "whether and how the metrics also go to W&B; a run tracked before continues its W&B run",
    "wandb.name": "the W&B run's display name",
}


def may_change(key: str) -> bool:
    """Whether a resume may change `key` (dotted, e.g. "train.steps")."""
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in MAY_CHANGE_ON_RESUME)


def run_settings(config: Config) -> dict[str, Any]:
    """The settings that change the run (every key `may_change` refuses), as dotted keys: what each
    checkpoint records, so a resume is checked even where config.yaml is gone or edited."""
    return {key: value for key, value in flatten(to_dict(config)).items() if not may_change(key)}


def resume_config(run_dir: str | Path, config: Config, log: Callable[[str], None] = print,
                  trained_with: Optional[Mapping[str, Any]] = None, warn: Callable[[str], None] = warning) -> Config:
    """The config a resume in `run_dir` records: `config`, checked against the stored config.yaml
    and against `trained_with`, the run-changing settings the checkpoint recorded (`run_settings`),
    which win over config.yaml's: a deleted or edited config.yaml does not hide a change.

    Refuses (`ConfigError`, one line naming every key, old -> new) a change to a key that changes
    the run; logs the allowed changes. `replay.backend: auto` matches the backend stored. With
    `replay.calibrate_steps` > 0 the stored `samples_per_insert` (the calibrated one) is kept.
    A value taken from config.yaml is validated like the command line's: an edited config.yaml
    is refused (`ConfigError`, exit code 2 from the CLI), never trained on unchecked. A value of
    config.yaml that `trained_with` overrules (a hand edit) is said in one `warn` line (stderr).
    Only reads: every process of a multi-host run can call it. Neither config.yaml nor
    `trained_with`: `config` itself."""
    path = Path(run_dir) / CONFIG_FILE
    old: dict[str, Any] = {}
    if path.exists():
        stored = read_yaml(path, "the run's stored config")
        if not isinstance(stored, dict):
            raise ConfigError(f"the run's stored config {path} is not a mapping of sections; move it away to start "
                              "afresh")
        old = flatten(stored)
    elif trained_with is None:
        return config
    in_file = dict(old)
    old.update(trained_with or {})  # the checkpoint's record of what the run computed with
    new, default = flatten(to_dict(config)), flatten(to_dict(Config()))
    refused, allowed, adopted = [], [], []
    for key, after in new.items():
        before = old.get(key, default.get(key))  # a key added since the run began: it ran with the default
        if before == after:  # plain YAML values both: lists for tuples
            continue
        change = f"{key}: {show(before)} -> {show(after)}"
        if key == "replay.backend" and "auto" in (before, after):  # `auto` resolved to the backend the run has
            if after == "auto":
                config = _with_replay(config, backend=before)
                adopted.append(key)
        elif key == "replay.samples_per_insert" and config.replay.calibrate_steps > 0:
            log(f"resume: keeping the calibrated replay.samples_per_insert {show(before)} (not {after})")
            config = _with_replay(config, samples_per_insert=before)
            adopted.append(key)
        elif may_change(key):
            allowed.append(change)
        else:
            refused.append(change)
    entries = tuple(f"{key}." for key in mapping_keys())
    for key in sorted(set(old) - set(new)):  # an entry of a mapping (task.dataset_config) the run had and this lacks
        if key.startswith(entries) and not may_change(key):
            refused.append(f"{key}: {show(old[key])} -> (unset)")
    where = getattr(run_dir, "url", path.parent)  # a bucket run dir by its URL, not its local mirror
    if refused:
        raise ConfigError(f"{'; '.join(refused)}; these change the run in {where}, so a resume with them is "
                          "refused: use a new run.dir, or restore the old values")
    final = flatten(to_dict(config))
    overruled = [key for key, value in (trained_with or {}).items()
                 if key in in_file and in_file[key] != value and final.get(key) == value]
    if overruled:
        warn(f"{storage.join(str(where), CONFIG_FILE)} was edited: it says "
            f"{', '.join(f'{k}: {show(in_file[k])}' for k in overruled)}, but the run goes on with "
            f"{', '.join(f'{k}: {show(final[k])}' for k in overruled)}, as its checkpoint was trained, and the file "
            "is rewritten to that (a resume cannot change these: use a new run.dir)")
    if adopted:
        try:
            config_from_raw(to_dict(config), local=False)
        except ConfigError as e:
            raise ConfigError(f"the run's stored config {path}, read for {', '.join(adopted)}: {e}; restore "
                              f"the value the run wrote, or use a new run.dir") from None
    if allowed:
        log(f"resume with changed settings, recorded in {path}: {'; '.join(allowed)}")
    return config


def _with_replay(config: Config, **changes: Any) -> Config:
    return dataclasses.replace(config, replay=dataclasses.replace(config.replay, **changes))


class RunRecorder:
    """Writes one run's records; `open` it once per invocation, after the checkpoint step is known."""

    def __init__(self, run_dir: Path, config: Config, metrics: MetricsWriter):
        self.run_dir, self._config, self._metrics = run_dir, config, metrics

    @classmethod
    def open(cls, run_dir: Any, config: Config, resume_step: Optional[int],
             log: Callable[[str], None] = print, trained_with: Optional[Mapping[str, Any]] = None,
             warn: Callable[[str], None] = warning) -> "RunRecorder":
        """`run_dir`: a `rundir.RunDir` or a local path; `resume_step`: the checkpoint step the run
        resumes from, or None for a fresh start (whatever an earlier attempt without a checkpoint
        left is then overwritten); `trained_with`: that step's recorded run-changing settings
        (`resume_config`)."""
        where = run_dir
        if resume_step is not None:
            config = resume_config(run_dir, config, log, trained_with, warn)  # may refuse: nothing is written before it
        run_dir = Path(run_dir)
        write_atomic(run_dir / CONFIG_FILE, _yaml(config))
        dropped = keep_metrics_through(run_dir / METRICS_FILE, -1 if resume_step is None else resume_step)
        if dropped:
            log(f"{METRICS_FILE}: dropped {dropped} rows " + (
                "of an earlier attempt that left no checkpoint" if resume_step is None
                else f"past the checkpoint at step {resume_step} (or torn)"))
        tracker = Tracker.open(where, config, resume_step, log)
        metrics = MetricsWriter(run_dir, purge_step=0 if resume_step is None else resume_step + 1, tracker=tracker)
        return cls(run_dir, config, metrics)

    @property
    def config(self) -> Config:
        """The config as recorded: what the run uses."""
        return self._config

    def update_config(self, config: Config) -> None:
        """Records `config` as the run's settings (e.g. with the calibrated samples_per_insert)."""
        self._config = config
        write_atomic(self.run_dir / CONFIG_FILE, _yaml(config))
        if self._metrics.tracker is not None:
            self._metrics.tracker.update_config(config)

    def write(self, step: int, record: Mapping[str, Any]) -> dict[str, Any]:
        """Appends one step's metrics (to metrics.jsonl and TensorBoard); returns the JSON record."""
        return self._metrics.write(step, record)

    def summary(self, summary: Mapping[str, Any]) -> None:
        write_atomic(self.run_dir / SUMMARY_FILE, json.dumps(dict(summary), indent=2) + "\n")
        if self._metrics.tracker is not None:
            self._metrics.tracker.summary(summary)

    def last_summary(self) -> dict[str, Any]:
        return last_summary(self.run_dir)

    def close(self) -> None:
        self._metrics.close()

    def __enter__(self) -> "RunRecorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def last_summary(run_dir: str | Path) -> dict[str, Any]:
    """The summary the run wrote when it last stopped (read, never rewritten), or {}."""
    try:
        summary = json.loads((Path(run_dir) / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def keep_metrics_through(path: Path, step: int) -> int:
    """Drops the rows of metrics.jsonl past `step`, and any line that is not a JSON record (a torn
    last line from a kill mid-write); returns how many. Rewritten atomically, only if it changes."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return 0
    kept, dropped = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            past = record["step"] > step
        except (ValueError, TypeError, KeyError):
            past = True
        if past:
            dropped += 1
        else:
            kept.append(line + "\n")
    new_text = "".join(kept)
    if new_text != text:
        write_atomic(path, new_text)
    return dropped


def write_atomic(path: Path, text: str) -> None:
    """`path` holds `text` or, after a kill at any moment, what it held before."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # a full disk: say which file, and leave no partial one taking space
        tmp.unlink(missing_ok=True)
        if e.filename:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e


def _yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)
