"""Replicating a sweep on new seeds (issue 50 item 5) and one rule for the paths in a sweep file (item 6).

`jaxreplay sweep FILE --replicate S,S --out DIR` runs the sweep's settings on seeds the study never
used, into a folder of its own; `jaxreplay report ... --replication DIR/*/seed*` sets them beside the
declared seeds and decides the claims again on them alone, never pooled into the declared verdicts.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jaxreplay.config import ConfigError
from jaxreplay.research.report import report
from jaxreplay.research.sweep import load_sweep, parse_pilots, run_sweep
from report_tables import markdown_tables
from test_report import CLAIMS, RUNS, _run_dir

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"


def _sweep(folder: Path, body: str = "", out: str = "runs") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sweep.yaml"
    path.write_text(f"base: {DEMO}\nout: {out}\nseeds: [0, 1, 2]\npilots: [900, 950-999]\n"
                    "settings:\n  on_policy: [replay.mode=on_policy]\n  spi2: []\n" + body)
    return path


# -- the sweep -----------------------------------------------------------------------------------
def test_a_replication_runs_the_same_settings_on_new_seeds_into_its_own_folder(tmp_path):
    path = _sweep(tmp_path / "study", CLAIMS.replace("  spi8_peak:", "  spi8_peak:").replace("[spi8]", "[spi2]"))
    study = load_sweep(path)
    rep = load_sweep(path, ["train.steps=7"], replicate=[31, 47], replicate_out=tmp_path / "rep")
    assert {(r.setting, r.seed) for r in rep.runs} == {(s, n) for s in ("on_policy", "spi2") for n in (31, 47)}
    assert all(r.dir == tmp_path / "rep" / r.setting / f"seed{r.seed}" for r in rep.runs)
    mine = {r.setting: r.config for r in study.runs if r.seed == 0}
    for r in rep.runs:  # the same settings as the study's runs, the seed and folders apart
        assert r.config.replay == mine[r.setting].replay and r.config.train.steps == 7
        assert r.config.warmstart.cache_dir == str(tmp_path / "rep" / ".warmstart-cache")
    for run in rep.runs:  # all finished: skipped, but the replication is marked and its claims written first
        run.dir.mkdir(parents=True)
        (run.dir / "summary.json").write_text(json.dumps({"steps": run.config.train.steps}))
    run_sweep(rep, log=lambda _: None)
    marked = yaml.safe_load((tmp_path / "rep" / "replication.yaml").read_text())
    assert marked["seeds"] == [31, 47] and marked["declared_seeds"] == [0, 1, 2]
    assert (tmp_path / "rep" / "claims.yaml").exists() and not (tmp_path / "study" / "runs").exists()


def test_a_replication_refuses_the_studys_seeds_its_pilots_and_its_own_folder(tmp_path):
    path = _sweep(tmp_path / "study")
    for seed, why in ((1, "one of the sweep's seeds"), (900, "a pilot's"), (960, "a pilot's")):
        with pytest.raises(ConfigError, match=f"--replicate: seed {seed} is .*{why}"):
            load_sweep(path, replicate=[31, seed], replicate_out=tmp_path / "rep")
    for inside in (tmp_path / "study" / "runs", tmp_path / "study" / "runs" / "rep", tmp_path / "study"):
        with pytest.raises(ConfigError, match="--out: .* the study's own folder"):
            load_sweep(path, replicate=[31], replicate_out=inside)
    with pytest.raises(ConfigError, match="needs --out"):
        load_sweep(path, replicate=[31])
    with pytest.raises(ConfigError, match="--seeds picks among the sweep's own"):
        load_sweep(path, only_seeds=[0], replicate=[31], replicate_out=tmp_path / "rep")
    assert parse_pilots([900, "950-952"]) == {900, 950, 951, 952}
    with pytest.raises(ConfigError, match="sweep.pilots: '9-1' is neither"):
        parse_pilots(["9-1"])


def test_a_stage2_replication_refuses_its_stage1_seeds_and_its_pilots_listed_in_the_committed_files():
    path = ROOT / "configs" / "sweep_mul_stage2.yaml"
    with pytest.raises(ConfigError, match="seed 101 is .*stage 1"):  # results/mul_stage1's runs: seeds 100-102
        load_sweep(path, replicate=[101], replicate_out="elsewhere")
    with pytest.raises(ConfigError, match="seed 900 is listed as a pilot's"):
        load_sweep(path, replicate=[900], replicate_out="elsewhere")
    for name in ("sweep_mul_stage1.yaml", "sweep_mul_stage2.yaml"):
        raw = yaml.safe_load((ROOT / "configs" / name).read_text())
        assert {900, 0, 199, 999} <= parse_pilots(raw["pilots"]) and 200 not in parse_pilots(raw["pilots"])
    rep = load_sweep(path, replicate=[231], replicate_out="elsewhere")
    assert {r.arm for r in rep.runs} == {"on_policy", "spi2_nr16", "spi4_nr2", "spi4_nr16", "spi8_nr16"}


# -- one rule for paths ----------------------------------------------------------------------------
def test_every_path_in_a_sweep_file_is_relative_to_the_file_from_any_working_directory(tmp_path, monkeypatch):
    path = _sweep(tmp_path / "a" / "b", out="../runs").with_name("sweep.yaml")
    path.write_text(path.read_text().replace("seeds:", "overrides: [warmstart.cache_dir=cache]\nseeds:"))
    monkeypatch.chdir(tmp_path / "a")
    sweep = load_sweep(path)
    assert {r.dir.resolve().parent.parent for r in sweep.runs} == {tmp_path / "a" / "runs"}
    assert {Path(r.config.warmstart.cache_dir).resolve() for r in sweep.runs} == {tmp_path / "a" / "b" / "cache"}
    # a command line override is the shell's: relative to the working directory
    sweep = load_sweep(path, ["warmstart.cache_dir=mine"])
    assert {Path(r.config.warmstart.cache_dir).resolve() for r in sweep.runs} == {tmp_path / "a" / "mine"}


def test_print_shows_where_the_committed_sweeps_runs_go_from_another_directory(tmp_path):
    out = subprocess.run([sys.executable, "-m", "jaxreplay.cli", "sweep",
                          str(ROOT / "configs" / "sweep_mul_stage2.yaml"), "--print"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    dirs = {(tmp_path / a.split("=", 1)[1]).resolve() for line in out.stdout.splitlines() for a in line.split()
            if a.startswith("run.dir=")}
    assert len(dirs) == 40 and {d.parent.parent for d in dirs} == {ROOT / "runs" / "mul_stage2"}
    assert f"# runs go under {ROOT / 'runs' / 'mul_stage2'}\n" in out.stderr


# -- the report ------------------------------------------------------------------------------------
REPLICATION = [  # seeds 10-12: on_policy as seeds 0-2, spi2 0.3 below it at every evaluation after the start
    ("on_policy", 10 + seed, acc, mu, entropy) for _, seed, acc, mu, entropy in RUNS[:3]
] + [("spi2", 10 + seed, [acc[0], *(a - 0.3 for a in acc[1:])], mu, entropy) for _, seed, acc, mu, entropy in RUNS[:3]]


@pytest.fixture
def dirs(tmp_path):
    study = [_run_dir(tmp_path / "study", *run) for run in RUNS]
    (tmp_path / "study" / "claims.yaml").write_text(yaml.safe_dump(yaml.safe_load(CLAIMS)["claims"]))
    rep = [_run_dir(tmp_path / "rep", *run) for run in REPLICATION]
    (tmp_path / "rep" / "replication.yaml").write_text(yaml.safe_dump({"seeds": [10, 11, 12]}))
    return study, rep


def test_the_report_decides_the_claims_again_on_the_replication_alone_never_pooled(dirs, tmp_path):
    study, rep = dirs
    report(study, tmp_path / "alone")
    report(study, tmp_path / "both", replication=rep)
    alone = markdown_tables((tmp_path / "alone" / "report.md").read_text())
    both = markdown_tables((tmp_path / "both" / "report.md").read_text())
    assert both["Claims and verdicts"] == alone["Claims and verdicts"]  # the confirmatory verdicts are unmoved
    again = both["Replication: the claims decided again on its seeds alone"]
    # declared: paired peak differences 0.1, 0.05, -0.15 (holds); replication: -0.3 on every seed (fails)
    keeps = again["spi 2 keeps the peak"]
    assert keeps["paired numbers"] == "IQM -0.3 [-0.3 ±0, -0.3 ±0] over 3 paired seeds; above on_policy in 0/3"
    assert keeps["verdict"] == "fails" and alone["Claims and verdicts"]["spi 2 keeps the peak"]["verdict"] == "holds"
    assert again["spi 8 keeps the peak"]["verdict"] == "not reported: no runs of spi8"
    beside = both["Replication beside the declared seeds"]
    assert beside["spi2"]["seeds (declared / replication)"] == "3 / 3"
    assert beside["spi2"]["peak (replication)"] == beside["on_policy (baseline)"]["peak (replication)"].replace(
        "0.6 [0.6, 0.65]", "0.3 [0.3, 0.35]")
    assert beside["spi8"]["seeds (declared / replication)"] == "2 / 0" and beside["spi8"]["peak (replication)"] == "n/a"
    md = (tmp_path / "both" / "report.md").read_text()
    assert "Seeds 10, 11, 12" in md
    # and it rebuilds byte for byte from its copies, the replication's apart
    assert "`jaxreplay report runs/*/* --out . --replication replication/*/*`" in md
    copies = sorted(p for p in (tmp_path / "both" / "runs").glob("*/*") if p.is_dir())
    rep_copies = sorted(p for p in (tmp_path / "both" / "replication").glob("*/*") if p.is_dir())
    assert len(rep_copies) == 6 and (tmp_path / "both" / "replication" / "replication.yaml").exists()
    report(copies, tmp_path / "again", replication=rep_copies)
    assert (tmp_path / "again" / "report.md").read_text() == md


def test_replication_runs_are_refused_as_study_runs_and_on_the_studys_seeds(dirs, tmp_path):
    study, rep = dirs
    with pytest.raises(ConfigError, match="is a replication's run .* give it with --replication"):
        report(study + rep, tmp_path / "out")
    with pytest.raises(ConfigError, match="--replication: seed 0 is also one of the study's runs"):
        report(study, tmp_path / "out", replication=study[:3])
