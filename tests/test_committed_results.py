"""The committed sweeps under results/: each keeps its runs, and each report rebuilds from them byte for byte.

Slow (a whole report per sweep, the two-stage ones with their stage-1 runs): run once, on the default lane;
the report's code is the same on every tier.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_committed_results_keep_their_runs():
    out = subprocess.run(["git", "check-ignore", "-q", "results/sweep/runs/on_policy/seed0/metrics.jsonl"],
                         cwd=ROOT, timeout=30)
    assert out.returncode == 1  # not ignored (0 would be: ignored)
    sweeps = sorted(p for p in (ROOT / "results").iterdir() if p.is_dir())
    assert sweeps, "results/ should hold the committed sweeps"
    for sweep in sweeps:
        assert (sweep / "report.md").is_file() and list((sweep / "runs").glob("*/seed*/metrics.jsonl")), sweep.name


COMMITTED = sorted(p.parent for p in (ROOT / "results").glob("*/report.md"))


@pytest.mark.slow
@pytest.mark.parametrize("folder", COMMITTED, ids=lambda p: p.name)
def test_every_committed_sweeps_report_rebuilds_byte_for_byte_from_its_runs(folder, tmp_path):
    """What a reviewer does: copy the committed runs (and a stage-2 report's stage-1 runs), run the command
    the report names with its globs expanded as a shell would, compare (and a stage-1 report's selection)."""
    md = (folder / "report.md").read_text()
    command = re.search(r"`(jaxreplay report runs/\*/\* --out \.[^`]*)`", md).group(1)
    for sub in ("runs", "stage1"):
        if (folder / sub).is_dir():
            shutil.copytree(folder / sub, tmp_path / sub)
    args = [a for arg in command.split()[2:]  # after "jaxreplay report"
            for a in (sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob(arg) if p.is_dir()) if "*" in arg
                      else [arg])]
    out = subprocess.run([sys.executable, "-m", "jaxreplay.cli", "report", *args], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "report.md").read_text() == md
    if (folder / "selected.yaml").exists():
        assert (tmp_path / "selected.yaml").read_bytes() == (folder / "selected.yaml").read_bytes()
