"""`jaxreplay sweep SWEEP.yaml`: a grid of settings x seeds, one run after another.

A sweep file names a base config, overrides common to every run, the settings (each a
list of dotted overrides) and the seeds:

    base: demo.yaml            # every path in a sweep file is relative to the sweep file
    out: ../runs/sweep_demo    # run dirs are OUT/SETTING/seedS
    seeds: [0, 1, 2]
    pilots: [900, 950-999]     # seeds of pilot runs (and LO-HI ranges): never a replication's
    overrides: [train.steps=300]
    settings:
      on_policy: [replay.mode=on_policy]
      spi4: [replay.samples_per_insert=4]
    timeout_s: 3600            # per run
    claims: {...}              # rules deciding the claims, written before any run (report_claims)
    regime: {...}              # the rule for "on-policy exhausted its pool" (report_regime)

Two stages (docs/comparing.md, "Two stages"): a stage-1 file adds `learning_rates: [1e-4, 3e-4, 1e-3]`
(or a mapping, each setting's own grid: `{on_policy: [...], spi4: [...]}`) and
`select: {measure: validation_peak, statistic: median}` (report_select): every setting (an arm)
runs at each rate of its grid, in OUT/ARM.lrLR/seedS with train.learning_rate set by the sweep, and the rule is
written to OUT/select.yaml before the first run. A stage-2 file names its stage 1 with `stage1: DIR`
(the stage-1 report's folder holding selected.yaml, relative to the sweep file) and sets each arm's
train.learning_rate explicitly; a rate other than stage 1's choice for that arm is refused.

Each run is a `jaxreplay train` subprocess (its own Reverb server, native logs and
memory), logging to RUN_DIR/train.log. A run whose summary.json reports all its steps
is skipped; any other run is started, and `jaxreplay train` resumes it from its latest
checkpoint. `--print` prints one command per run instead, for a cluster scheduler. Dotted
overrides after the sweep file apply to every run (`jaxreplay sweep FILE train.steps=50`).
Paths (docs/comparing.md, "Paths in a sweep file"): `base`, `stage1`, `out` and a path-valued override
(`PATH_KEYS`) in the file resolve relative to the sweep file, wherever the command runs; the commands
`--print` shows name them relative to the working directory. Overrides on the command line are the
shell's, relative to the working directory.

`--replicate S,S --out DIR` (`replicate`) runs the same runs on new seeds into DIR: the seeds may be
none of the sweep's, its stage 1's or its pilots', and DIR neither the sweep's out nor inside it nor
around it; DIR/replication.yaml marks them, so that `jaxreplay report` keeps them apart
(`--replication`) and never pools them with the declared seeds.

`--settings NAME,NAME` (`pick_settings`) keeps some of the file's settings, by name or by a shell
pattern (`'*_p128'`: one pool's arms), with the run, `--print`, `--seeds` and `--replicate` alike. A
replication of a subset lists it in replication.yaml; its report decides the claims that read only
those settings and names the others "not decided by the replication".

Every run's config is loaded and validated before the first one starts, and so are the claims,
which are written to OUT/claims.yaml before the first run for `jaxreplay report` to decide. Every setting of
a seed shares its warm start, cached in OUT/.warmstart-cache unless an override names another.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import yaml

from jaxreplay.config import Config, ConfigError, did_you_mean, load_config, read_yaml, show
from jaxreplay.research.report_claims import CLAIMS_FILE, REPLICATION_FILE, parse_claims
from jaxreplay.research.report_regime import REGIME_FILE, parse_regime
from jaxreplay.research.report_select import (
    SELECT_FILE, SELECTED_FILE, lr_tag, parse_learning_rate, parse_rule, read_selected, setting_name)

_KEYS = {"base", "out", "seeds", "overrides", "settings", "timeout_s", "claims", "learning_rates", "select", "stage1",
         "pilots", "regime"}
# Config keys whose value is a path: in a sweep file's overrides, relative to the sweep file like its other paths.
PATH_KEYS = ("warmstart.cache_dir", "task.path", "task.data_dir")
_PILOT_RANGE = re.compile(r"([0-9]+)-([0-9]+)")
_LR = "train.learning_rate"
_NAME = re.compile(r"[A-Za-z0-9_.+-]+")


@dataclasses.dataclass(frozen=True)
class Run:
    setting: str
    seed: int
    base: Path
    overrides: tuple[str, ...]  # common, then the setting's, then seed and run dir
    config: Config
    arm: str = ""  # the sweep file's setting; `setting` adds the learning rate in a stage-1 sweep (ARM.lrLR)

    @property
    def dir(self) -> Path:
        return Path(self.config.run.dir)

    def argv(self, program: tuple[str, ...] = ("jaxreplay",)) -> list[str]:
        return [*program, "train", str(self.base), *self.overrides]

    def is_done(self) -> bool:
        """summary.json written by a run that reached all its steps, or spent its token budget."""
        try:
            summary = json.loads((self.dir / "summary.json").read_text())
        except (OSError, ValueError):
            return False
        budget = self.config.train.max_generated_tokens
        return summary.get("steps") == self.config.train.steps or 0 < budget <= summary.get("tokens/generated", 0)


@dataclasses.dataclass(frozen=True)
class Sweep:
    runs: tuple[Run, ...]
    timeout_s: float
    out: Path = Path(".")
    claims: Any = None  # the sweep file's claims, as written (validated by report_claims.parse_claims)
    select: Any = None  # a stage-1 sweep's rule picking each arm's learning rate (report_select.parse_rule)
    replication: Any = None  # a replication's record (REPLICATION_FILE): the sweep file, its seeds, the new ones
    regime: Any = None  # the exhaustion rule some claims are decided under (report_regime)


def is_sweep_file(path: str | Path) -> bool:
    """Whether `path` reads as a sweep file (a `base` and its `settings`), for the commands that
    take a run's config to point to `jaxreplay sweep` instead of naming an unknown key."""
    try:
        raw = read_yaml(path, "sweep file")
    except ConfigError:
        return False
    return isinstance(raw, dict) and {"base", "settings"} <= set(raw)


def here(path: Path | str) -> Path:
    """A path resolved elsewhere, as the working directory reaches it (relative where it is relative)."""
    return Path(os.path.relpath(path)) if Path(path).is_absolute() else Path(path)


def _from_file(sweep_file: Path, value: Any) -> Path:
    """A path written in the sweep file: relative to the file's folder unless absolute."""
    p = Path(str(value))
    return p if p.is_absolute() else here((sweep_file.parent / p).absolute())


def _paths_from_file(sweep_file: Path, overrides: tuple[str, ...]) -> tuple[str, ...]:
    """The file's overrides with each path-valued one (`PATH_KEYS`) resolved like the file's other paths."""
    out = []
    for v in overrides:
        key, value = v.split("=", 1)
        out.append(f"{key}={_from_file(sweep_file, value)}" if key in PATH_KEYS and value and "://" not in value
                   else v)
    return tuple(out)


def parse_pilots(raw: Any) -> frozenset[int]:
    """The seeds a sweep file lists as its pilots': integers and inclusive ranges written "LO-HI"."""
    if raw is None:
        return frozenset()
    if not isinstance(raw, list):
        raise ConfigError(f"sweep.pilots: expected a list of seeds and LO-HI ranges like [900, 950-999], "
                          f"got {show(raw)}")
    seeds: set[int] = set()
    for item in raw:
        if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            seeds.add(item)
        elif isinstance(item, str) and (m := _PILOT_RANGE.fullmatch(item.strip())) and int(m[1]) <= int(m[2]):
            seeds.update(range(int(m[1]), int(m[2]) + 1))
        else:
            raise ConfigError(f"sweep.pilots: {show(item)} is neither a seed nor a range LO-HI like 950-999")
    return frozenset(seeds)


def _stage1_seeds(folder: Path) -> set[int]:
    """The seeds of a stage-1 report's runs (FOLDER/runs/SETTING/seedS)."""
    return {int(d.name[4:]) for d in folder.glob("runs/*/seed*") if d.name[4:].isdigit()}


def _inside(a: Path, b: Path) -> bool:
    a, b = a.resolve(), b.resolve()
    return a == b or b in a.parents


def load_sweep(path: str | Path, overrides: Sequence[str] = (), only_seeds: Sequence[int] | None = None,
               replicate: Sequence[int] | None = None, replicate_out: str | Path | None = None,
               only_settings: Sequence[str] | None = None) -> Sweep:
    """Parses and validates the sweep file and every run's config; `ConfigError` names the problem.

    `overrides` (the command line's) apply to every run after the file's own overrides and
    the setting's; the seed and run dir stay the sweep's. `only_seeds` keeps a subset of the
    file's seeds, to split one sweep over several machines or cores; `only_settings` (names or
    shell patterns like `*_p128`, `pick_settings`) a subset of its settings, e.g. the two arms a
    replication checks. `replicate` runs the settings on these new seeds instead, into
    `replicate_out` (see the module's docstring)."""
    path = Path(path)
    extra = _override_list(list(overrides), "sweep (command line)")
    raw = read_yaml(path, "sweep file")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a sweep file is a mapping with keys {', '.join(sorted(_KEYS))}")
    unknown = sorted(set(raw) - _KEYS, key=str)
    if unknown:
        guess = did_you_mean(str(unknown[0]), _KEYS)
        raise ConfigError(f"sweep: unknown key {unknown[0]} (" + (f"did you mean {guess}?" if guess else
                                                                   f"known: {', '.join(sorted(_KEYS))}") + ")")
    for key in ("base", "out", "seeds", "settings"):
        if key not in raw:
            raise ConfigError(f"sweep.{key}: required")
    base = Path(str(raw["base"]))
    base = base if base.is_absolute() else (path.parent / base).resolve()
    seeds = raw["seeds"]
    if not (isinstance(seeds, list) and seeds and all(isinstance(s, int) and not isinstance(s, bool)
                                                      for s in seeds)):
        raise ConfigError(f"sweep.seeds: expected a non-empty list of integers, got {show(seeds)}")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"sweep.seeds: repeated seed in {seeds}")
    pilots = parse_pilots(raw.get("pilots"))
    common = _paths_from_file(path, _override_list(raw.get("overrides") or [], "sweep.overrides"))
    settings = raw["settings"]
    if not isinstance(settings, dict) or not settings:
        raise ConfigError("sweep.settings: expected a non-empty mapping of name -> list of overrides")
    timeout_s = raw.get("timeout_s", 3600)
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not 0 < timeout_s < math.inf:
        raise ConfigError(f"sweep.timeout_s: expected a positive number of seconds, got {show(timeout_s)}")
    out = _from_file(path, raw["out"])
    shared_warm_start = (f"warmstart.cache_dir={out / '.warmstart-cache'}",)  # overridable: it comes first
    own_overrides = {}
    for name, overrides in settings.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigError(f"sweep.settings: {show(name)} is not a usable directory name")
        own_overrides[name] = _paths_from_file(path, _override_list(overrides or [], f"sweep.settings.{name}"))
    grids, rule = _stage1(raw, common, own_overrides)
    selected = _stage2(raw, path, common, own_overrides, grids)
    picked = pick_settings(list(own_overrides), only_settings)
    replication = None
    if replicate is not None:
        if only_seeds is not None:
            raise ConfigError("--replicate: runs new seeds; --seeds picks among the sweep's own (give one of them)")
        if replicate_out is None:
            raise ConfigError("--replicate: needs --out DIR, a folder of its own apart from the study's "
                              f"({out})")
        stage1_seeds = _stage1_seeds(_from_file(path, raw["stage1"])) if raw.get("stage1") is not None else ()
        used = {**{s: "listed as a pilot's in the sweep file (sweep.pilots)" for s in pilots},
                **{s: f"a seed of its stage 1 ({raw['stage1']})" for s in stage1_seeds},
                **{s: "one of the sweep's seeds" for s in seeds}}
        for s in replicate:
            if s in used:
                raise ConfigError(f"--replicate: seed {s} is {used[s]}; a replication runs on seeds the study "
                                  "never used")
        if len(set(replicate)) != len(replicate):
            raise ConfigError(f"--replicate: repeated seed in {list(replicate)}")
        new_out = Path(replicate_out)
        if _inside(new_out, out) or _inside(out, new_out):
            raise ConfigError(f"--out: {new_out} is the study's own folder {out}, or in it or around it; a replication "
                              "goes into a folder of its own")
        replication = {"sweep": str(path), "out": str(out), "declared_seeds": list(seeds), "seeds": list(replicate),
                       **({"settings": picked} if len(picked) < len(own_overrides) else {})}
        seeds, out = list(replicate), new_out
        shared_warm_start = (f"warmstart.cache_dir={out / '.warmstart-cache'}",)
    elif replicate_out is not None:
        raise ConfigError("--out: only with --replicate (a sweep's runs go where its file's `out` says)")
    if only_seeds is not None:
        missing = [s for s in only_seeds if s not in seeds]
        if missing:
            raise ConfigError(f"--seeds: {missing[0]} is not one of the sweep's seeds {seeds}")
        seeds = [s for s in seeds if s in only_seeds]
    runs = []
    for seed in seeds:  # seed-major: a sweep stopped early has whole seeds, and claims pool seeds
        for name, own in own_overrides.items():
            if name not in picked:
                continue
            for lr in grids[name] if grids else (None,):
                setting = name if lr is None else setting_name(name, lr)
                rate = () if lr is None else (f"{_LR}={lr!r}",)
                args = (*shared_warm_start, *common, *own, *extra, *rate, f"run.seed={seed}",
                        f"run.dir={out / setting / f'seed{seed}'}", "run.progress_bar=false")
                try:
                    config = load_config(base, args)
                except ConfigError as e:
                    raise ConfigError(f"sweep.settings.{name} (seed {seed}): {e}") from None
                if selected is not None and not math.isclose(config.train.learning_rate, selected[name],
                                                             rel_tol=1e-9):
                    raise ConfigError(f"sweep.settings.{name}: train.learning_rate {lr_tag(config.train.learning_rate)}"
                                      f" is not stage 1's choice for this arm ({lr_tag(selected[name])}, "
                                      f"{raw['stage1']}/{SELECTED_FILE})")
                runs.append(Run(setting=setting, seed=seed, base=base, overrides=args, config=config, arm=name))
    claims = raw.get("claims")
    names = set(settings)
    regime = parse_regime(raw.get("regime"))
    if regime is not None and regime.setting not in names:
        raise ConfigError(f"sweep.regime.setting: {regime.setting} is not one of the settings")
    for claim in parse_claims(claims):
        unknown = [n for n in claim.names if n not in names]
        if unknown:
            where = "settings" if unknown[0] in claim.settings else (
                "baseline" if unknown[0] == claim.baseline else "contrast")
            raise ConfigError(f"sweep.claims.{claim.name}.{where}: {unknown[0]} is not one of the settings")
        if claim.regime and regime is None:
            raise ConfigError(f"sweep.claims.{claim.name}.regime: needs the sweep's `regime`, the exhaustion rule "
                              "declared before any run (report_regime)")
    return Sweep(runs=tuple(runs), timeout_s=float(timeout_s), out=out, claims=claims,
                 select=None if rule is None else rule.as_dict(), replication=replication,
                 regime=None if regime is None else regime.as_dict())


def pick_settings(names: Sequence[str], patterns: Sequence[str] | None) -> list[str]:
    """The settings `patterns` pick, in the sweep file's order: each a setting's name or a shell pattern
    (`*_p128`: one pool's arms), each matching at least one setting. None picks them all."""
    if patterns is None:
        return list(names)
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            guess = did_you_mean(pattern, names)
            raise ConfigError(f"--settings: {pattern} matches none of the sweep's settings ("
                              + (f"did you mean {guess}?" if guess else f"they are {', '.join(names)}") + ")")
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def _sets_lr(overrides: Sequence[str]) -> bool:
    return any(v.split("=", 1)[0] == _LR for v in overrides)


def _stage1(raw: dict, common: tuple[str, ...], own: dict[str, tuple[str, ...]]):
    """(each setting's learning rates, the rule) of a stage-1 file; (None, None) for any other.
    `learning_rates` is one grid for every setting, or a mapping giving each setting its own."""
    rates, rule = raw.get("learning_rates"), parse_rule(raw.get("select"))
    if rates is None:
        if rule is not None:
            raise ConfigError("sweep.select: a selection rule needs sweep.learning_rates, the grid it chooses from")
        return None, None
    if isinstance(rates, dict):
        for name in rates:
            if name not in own:
                raise ConfigError(f"sweep.learning_rates: {show(name)} is not one of the settings "
                                  f"({', '.join(own)})")
        missing = [name for name in own if name not in rates]
        if missing:
            raise ConfigError(f"sweep.learning_rates: no grid for the setting {missing[0]}; a mapping gives every "
                              "setting its own")
        grids = {name: _grid(rates[name], f"sweep.learning_rates.{name}") for name in own}
    else:
        grid = _grid(rates, "sweep.learning_rates")
        grids = {name: grid for name in own}
    if rule is None:
        raise ConfigError("sweep.select: required with sweep.learning_rates: the rule that picks each arm's learning "
                          "rate, declared before any run (e.g. {measure: validation_peak, statistic: median})")
    if raw.get("claims") is not None:
        raise ConfigError("sweep.claims: stage 1 (sweep.learning_rates) only chooses learning rates; declare the "
                          "claims in the stage-2 file")
    if raw.get("stage1") is not None:
        raise ConfigError("sweep.stage1: a stage-1 file (sweep.learning_rates) cannot name a stage 1")
    for where, overrides in (("sweep.overrides", common), *((f"sweep.settings.{n}", o) for n, o in own.items())):
        if _sets_lr(overrides):
            raise ConfigError(f"{where}: {_LR} is set by sweep.learning_rates")
    for name in own:
        if "." + "lr" in name:
            raise ConfigError(f"sweep.settings: {name} holds '.lr', which separates an arm from its learning rate")
    return grids, rule


def _grid(rates: Any, where: str) -> list[float]:
    if not isinstance(rates, list) or not rates:
        raise ConfigError(f"{where}: expected a non-empty list like [1e-4, 3e-4, 1e-3], got {show(rates)}")
    rates = [parse_learning_rate(v, where) for v in rates]
    tags = [lr_tag(v) for v in rates]
    if len(set(tags)) != len(tags):
        raise ConfigError(f"{where}: repeated learning rate in {', '.join(tags)}")
    return sorted(rates)


def _stage2(raw: dict, path: Path, common: tuple[str, ...], own: dict[str, tuple[str, ...]],
            grids) -> Optional[dict[str, float]]:
    """arm -> learning rate stage 1 selected, for a stage-2 file (None for any other), after checking that
    every setting sets its rate explicitly and is an arm stage 1 chose for."""
    if raw.get("stage1") is None or grids is not None:
        return None
    selected = read_selected(_from_file(path, raw["stage1"]), "sweep.stage1")
    for name, overrides in own.items():
        if name not in selected:
            raise ConfigError(f"sweep.settings.{name}: stage 1 selected no learning rate for this arm "
                              f"(it selected: {', '.join(selected)})")
        if not (_sets_lr(overrides) or _sets_lr(common)):
            raise ConfigError(f"sweep.settings.{name}: set {_LR} explicitly, to stage 1's choice "
                              f"{lr_tag(selected[name])}")
    return selected


def _override_list(value, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and "=" in v for v in value):
        raise ConfigError(f"{key}: expected a list of dotted overrides like train.steps=100, got {show(value)}")
    if any(v.split("=", 1)[0] in ("run.seed", "run.dir") for v in value):
        raise ConfigError(f"{key}: run.seed and run.dir are set by the sweep")
    return tuple(value)


def commands(sweep: Sweep) -> list[str]:
    """One shell command per run, for a cluster scheduler."""
    return [shlex.join(run.argv()) for run in sweep.runs]


def run_sweep(sweep: Sweep, log: Callable[[str], None] = print) -> dict[str, str]:
    """Runs every unfinished run in order; returns run dir -> "skipped" | "done" | "failed (...)".

    A failed run is reported and the sweep goes on: one bad seed should not cost the rest.
    """
    program = (sys.executable, "-m", "jaxreplay.cli")
    if sweep.replication:
        sweep.out.mkdir(parents=True, exist_ok=True)
        (sweep.out / REPLICATION_FILE).write_text(yaml.safe_dump(sweep.replication, sort_keys=False))
    if sweep.claims:
        sweep.out.mkdir(parents=True, exist_ok=True)
        (sweep.out / CLAIMS_FILE).write_text(yaml.safe_dump(sweep.claims, sort_keys=False, allow_unicode=True))
    if sweep.regime:
        sweep.out.mkdir(parents=True, exist_ok=True)
        (sweep.out / REGIME_FILE).write_text(yaml.safe_dump(sweep.regime, sort_keys=False))
    if sweep.select:
        sweep.out.mkdir(parents=True, exist_ok=True)
        (sweep.out / SELECT_FILE).write_text(yaml.safe_dump(sweep.select, sort_keys=False))
    results = {}
    for i, run in enumerate(sweep.runs, 1):
        tag = f"[{i}/{len(sweep.runs)}] {run.setting} seed {run.seed}"
        if run.is_done():
            results[str(run.dir)] = "skipped"
            log(f"{tag}: finished earlier, skipped ({run.dir})")
            continue
        run.dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        log(f"{tag}: {'resuming' if (run.dir / 'checkpoints').exists() else 'starting'} ({run.dir})")
        with open(run.dir / "train.log", "a") as out:
            try:
                rc = subprocess.run(run.argv(program), stdout=out, stderr=subprocess.STDOUT,
                                    timeout=sweep.timeout_s).returncode
            except subprocess.TimeoutExpired:
                rc = None
        seconds = time.perf_counter() - start
        if rc == 0 and run.is_done():
            results[str(run.dir)] = "done"
            log(f"{tag}: done in {seconds:.0f}s")
        else:
            why = f"timed out after {sweep.timeout_s:g}s" if rc is None else f"exit code {rc}"
            results[str(run.dir)] = f"failed ({why})"
            log(f"{tag}: FAILED ({why}); see {run.dir / 'train.log'}")
    return results
