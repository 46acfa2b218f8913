"""Run dirs for `jaxreplay report`: their metrics, grouped into settings, on the report's x axes.

Runs are grouped into settings: the seeds of one setting share their config except
the keys that say where or how a run was kept, not what it computed (`NOT_A_SETTING`:
its seed and dir, the warm-start cache's place, timeouts, ports, checkpoint cadence,
the progress bar), and a setting is named after the folder holding its run dirs (the
sweep layout OUT/SETTING/seedS).

The x axes, per evaluation step of a run:
- generated tokens and learner steps, as logged;
- modelled compute at mu: trained rollouts + mu x generated rollouts, in units of
  training one rollout (the paper's cost per update B + mu R, summed). The counts
  come from `rollouts/trained` and `rollouts/generated`; runs that predate them use
  step x train.batch_size and the table's inserts (which leave out rollouts still
  waiting for the table, at most one actor step's);
- wall-clock seconds without compilation: generate + train + replay seconds with
  the first generate and train call of each process left out
  (`time/generate_timed_s`, `time/train_timed_s`); runs that predate those count
  from their first learner step, which holds both first calls.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import yaml

from jaxreplay.config import ConfigError, read_yaml
from jaxreplay.learn.staleness import AGE_BUCKETS, key as by_age_key
from jaxreplay.train.eval import PASSK_KEY, TEST_KEY, VALIDATION_KEY
from jaxreplay.train.metrics import read_metrics

EVAL_FILE = "eval.json"  # `jaxreplay eval CONFIG --checkpoint RUN_DIR --k 1,8 --out RUN_DIR/eval.json`
SUMMARY_FILE = "summary.json"
# The metrics keys the report reads: a copied run keeps these (and every row holding one besides the step).
READ_KEYS = ("step", TEST_KEY, VALIDATION_KEY, "tokens/generated", "rollouts/generated", "rollouts/trained",
             "replay/inserts", "compute/flops", "cost/mu", "entropy", "approx_kl", "pg_clipfrac", "replay/ratio",
             "staleness/mean", "staleness/hist", "time/generate_s", "time/train_s", "time/replay_s",
             "time/generate_timed_s", "time/train_timed_s", "reward_mean")
AGE_STATS = ("rows", "clipfrac_low", "clipfrac_high", "kl_k3")  # the by-age statistics the report plots (report_age)
READ_KEYS += tuple(by_age_key(b, s) for b in AGE_BUCKETS for s in AGE_STATS)
_TIMES = ("time/generate_s", "time/train_s", "time/replay_s")
_TIMED = ("time/generate_timed_s", "time/train_timed_s", "time/replay_s")


def _number(value: Any) -> Optional[float]:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


@dataclasses.dataclass
class RunData:
    dir: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]
    final_eval: dict[str, Any] = dataclasses.field(default_factory=dict)  # RUN_DIR/eval.json, if any
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)  # RUN_DIR/summary.json, if any

    def __post_init__(self):
        self._by_step = {r["step"]: r for r in self.records}
        first = next((r for r in self.records if r["step"] > 0 and all(k in r for k in _TIMES)), None)
        self.timed = any("time/generate_timed_s" in r for r in self.records)
        self._time_offset = 0.0 if self.timed or first is None else sum(first[k] for k in _TIMES)

    @property
    def seed(self) -> Any:
        return self.config.get("run", {}).get("seed")

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) where `key` holds a finite number."""
        pairs = [(r["step"], v) for r in self.records if (v := _number(r.get(key))) is not None]
        steps, values = zip(*pairs) if pairs else ((), ())
        return np.asarray(steps, np.int64), np.asarray(values, np.float64)

    def evals(self) -> tuple[np.ndarray, np.ndarray]:
        return self.series("eval/accuracy")

    def last(self, key: str) -> Optional[float]:
        values = self.series(key)[1]
        return float(values[-1]) if len(values) else None

    def value(self, key: str, step: int) -> float:
        """`key` at `step`; the cumulative counters are 0 at step 0 (before any training); nan if absent."""
        if step == 0:
            return 0.0
        v = _number(self._by_step.get(step, {}).get(key))
        return math.nan if v is None else v

    def generated(self, step: int) -> float:
        rec = self._by_step.get(step, {})
        return self.value("rollouts/generated" if "rollouts/generated" in rec else "replay/inserts", step)

    def trained(self, step: int) -> float:
        if "rollouts/trained" in self._by_step.get(step, {}):
            return self.value("rollouts/trained", step)
        return float(step * self.config.get("train", {}).get("batch_size", math.nan))

    def seconds(self, step: int) -> float:
        """Wall-clock seconds at `step` without compilation (see the module docstring)."""
        total = sum(self.value(k, step) for k in (_TIMED if self.timed else _TIMES))
        return max(0.0, total - self._time_offset) if step else 0.0

    def x(self, axis: str, steps: Sequence[int], mu: Optional[float] = None) -> np.ndarray:
        """The report's x axis `axis` at each of `steps` (nan where a run lacks what it needs)."""
        at = {"steps": float, "tokens": lambda s: self.value("tokens/generated", s),
              "flops": lambda s: self.value("compute/flops", s), "wallclock": self.seconds,
              "compute": lambda s: self.trained(s) + mu * self.generated(s)}[axis]
        return np.array([at(int(s)) for s in steps], np.float64)

    def pass_at(self, k: str) -> Optional[float]:
        """pass@k (temperature 1.0) of the final policy, from RUN_DIR/eval.json."""
        return _number(self.final_eval.get(PASSK_KEY, {}).get(k))


@dataclasses.dataclass
class Setting:
    name: str
    runs: list[RunData]

    @property
    def replay(self) -> dict[str, Any]:
        return self.runs[0].config.get("replay", {})

    @property
    def on_policy(self) -> bool:
        return self.replay.get("mode") == "on_policy"

    @property
    def spi_target(self) -> float:
        return 1.0 if self.on_policy else float(self.replay.get("samples_per_insert", math.nan))

    def horizon(self) -> Optional[tuple[float, float]]:
        """(N/R in actor steps, the same window in learner steps N*spi/B); None on-policy.

        A rollout stays in the FIFO window for N/R actor steps, and the limiter lets the
        learner take spi*R/B steps per actor step: staleness (in learner steps) is bounded
        by N*spi/B, which equals N/R when B = spi*R, as the cost model assumes.
        """
        train = self.runs[0].config.get("train", {})
        if self.on_policy or not all(k in train for k in ("prompts_per_step", "group_size", "batch_size")):
            return None
        n, r = float(self.replay.get("max_size", math.nan)), float(train["prompts_per_step"] * train["group_size"])
        return n / r, n * self.spi_target / float(train["batch_size"])


def trimmed_metrics(records: Sequence[dict[str, Any]]) -> str:
    """metrics.jsonl with the `READ_KEYS` only, in each row's own key order: what the report
    reads, a fraction of the size; trimming it again changes nothing."""
    rows = [{k: v for k, v in r.items() if k in READ_KEYS} for r in records]
    return "".join(json.dumps(r) + "\n" for r in rows if len(r) > 1)


def copy_run(run: RunData, dest: Path) -> None:
    """DEST/{config.yaml, summary.json, eval.json (as they are), metrics.jsonl (trimmed)}: what
    `jaxreplay report` reads, small enough to commit. No checkpoints, replay files or events."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.yaml", SUMMARY_FILE, EVAL_FILE):
        src = run.dir / name
        if src.exists() and src.resolve() != (dest / name).resolve():
            (dest / name).write_bytes(src.read_bytes())
    (dest / "metrics.jsonl").write_text(trimmed_metrics(run.records))


def load_runs(run_dirs: Sequence[str | Path]) -> list[RunData]:
    runs = []
    for d in map(Path, run_dirs):
        if not (d / "metrics.jsonl").exists() or not (d / "config.yaml").exists():
            raise ConfigError(f"{d} is not a run dir (needs metrics.jsonl and config.yaml)")
        try:
            extra = {name: json.loads((d / name).read_text()) if (d / name).exists() else {}
                     for name in (EVAL_FILE, SUMMARY_FILE)}
            config, records = yaml.safe_load((d / "config.yaml").read_text()), read_metrics(d)
        except (ValueError, yaml.YAMLError) as e:  # JSONDecodeError is a ValueError
            raise ConfigError(f"{d}: unreadable run file: {' '.join(str(e).split())}") from None
        runs.append(RunData(dir=d, config=config, records=records, final_eval=extra[EVAL_FILE],
                            summary=extra[SUMMARY_FILE]))
        if not len(runs[-1].evals()[0]):
            raise ConfigError(f"{d} has no eval/accuracy in metrics.jsonl")
    if not runs:
        raise ConfigError("no run dirs given")
    return runs


NOT_A_SETTING = ("run.seed", "run.dir", "run.progress_bar", "warmstart.cache_dir", "*.timeout_s", "replay.port",
                 "checkpoint.*")


def setting_key(config: dict, ignore: Sequence[str] = NOT_A_SETTING, prefix: str = "") -> dict:
    """`config` without the keys matching `ignore` (dotted patterns; `NOT_A_SETTING` by default)."""
    kept = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            if inner := setting_key(value, ignore, f"{dotted}."):
                kept[key] = inner
        elif not any(fnmatch.fnmatchcase(dotted, pattern) for pattern in ignore):
            kept[key] = value
    return kept


def group_settings(runs: Sequence[RunData]) -> list[Setting]:
    """Groups runs whose configs differ only in `NOT_A_SETTING`; each group named after its run dirs' parent folder."""
    groups: dict[str, list[RunData]] = {}
    for run in runs:
        groups.setdefault(yaml.safe_dump(setting_key(run.config), sort_keys=True), []).append(run)
    settings, used = [], set()
    for members in groups.values():
        name = members[0].dir.resolve().parent.name or members[0].dir.name
        base, i = name, 2
        while name in used:
            name, i = f"{base}#{i}", i + 1
        used.add(name)
        settings.append(Setting(name=name, runs=sorted(members, key=lambda r: r.seed or 0)))
    return settings


def pick_baseline(settings: Sequence[Setting], name: Optional[str]) -> Setting:
    if name is not None:
        for s in settings:
            if s.name == name:
                return s
        raise ConfigError(f"--baseline {name!r} is not one of the settings: {', '.join(s.name for s in settings)}")
    on_policy = [s for s in settings if s.on_policy]
    if len(on_policy) != 1:
        raise ConfigError(f"found {len(on_policy)} on-policy settings; name the baseline with --baseline "
                          f"(settings: {', '.join(s.name for s in settings)})")
    return on_policy[0]


def measured_mu(runs: Sequence[RunData]) -> Optional[float]:
    """Median over runs of each run's last logged cost/mu (None if no run logged one)."""
    mus = [m for r in runs if (m := r.last("cost/mu")) is not None]
    return float(np.median(mus)) if mus else None


def declared(sweep: Optional[str | Path], run_dirs: Sequence[Path], key: str, file_name: str,
             many: str) -> tuple[Any, Optional[str]]:
    """(what a sweep declared under `key`, where it came from): from the sweep file when given,
    else from the `file_name` the sweep wrote beside the runs' setting folders ((None, None): no
    such file). Runs of several sweeps that each wrote one are an error ending in `many`."""
    if sweep is not None:
        raw = read_yaml(Path(sweep), "sweep file")
        return (raw.get(key) if isinstance(raw, dict) else None), None
    found = {p for d in run_dirs if (p := Path(d).resolve().parent.parent / file_name).exists()}
    if len(found) > 1:
        raise ConfigError(f"runs from {len(found)} {many}")
    return (yaml.safe_load(found.pop().read_text()), file_name) if found else (None, None)
