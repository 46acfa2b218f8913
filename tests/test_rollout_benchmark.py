"""`python -m benchmarks.run rollout --quick` runs end to end (tiny sizes), so it cannot rot."""

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import rollout, run


def test_quick_rollout_benchmark_prints_one_line_a_workload_in_order_then_the_full_batch_check(tmp_path, capsys):
    out = tmp_path / "rollout.json"
    results = run.main(["rollout", "--quick", "--out", str(out)])
    assert json.loads(out.read_text())["rollout"] == results["rollout"]
    names = [r["workload"] for r in results["rollout"]]
    assert names == ["long-tail", "shared-prompt", "demo-long", "full-batch"]
    for r in results["rollout"]:
        assert r["static"] > 0 and r["engine"] > 0 and abs(r["ratio"] - r["engine"] / r["static"]) < 1e-9
        assert len(r["static_seconds"]) == len(r["engine_seconds"]) == rollout.QUICK["rounds"]
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rollout ")]
    assert [line.split()[1] for line in printed] == names and all(" ratio=" in line for line in printed)
    assert 0 < results["rollout"][0]["mean_len_engine"] <= rollout.QUICK["tail"]["cap"]
    assert results["rollout"][-1]["static_vs_itself"] > 0 and " static_vs_itself=" in printed[-1]
    assert set(rollout.FULL) == set(rollout.QUICK), "the full run has every workload's sizes"


def test_device_script_rollout_mode_dry_runs_on_cpu_and_refuses_a_full_run_without_an_accelerator(tmp_path):
    """`benchmarks/device.sh OUT --rollout` is the GPU/TPU run of long-tail and shared-prompt;
    here only its dry run (`--quick`) can run, and a full run is refused in one line."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "device.sh"
    env = {**os.environ, "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu", "PYTHONDONTWRITEBYTECODE": "1"}
    sh = lambda *args: subprocess.run(["bash", str(script), str(tmp_path), *args], env=env, capture_output=True,
                                      text=True, timeout=600)
    result = sh("--rollout", "--quick")
    assert result.returncode == 0, result.stderr
    results = json.loads((tmp_path / "rollout.json").read_text())
    assert [r["workload"] for r in results["rollout"]] == ["long-tail", "shared-prompt"]
    assert all(r["engine_step_s"] > 0 and r["engine_step_bytes"] > 0 for r in results["rollout"])
    assert [line.split()[1] for line in result.stdout.splitlines()] == ["long-tail", "shared-prompt"]
    refused = sh("--rollout")
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0 and "accelerator" in refused.stderr


def test_quick_chunk_length_benchmark_times_each_chunk_length_against_the_default_and_the_static_side():
    results = run.main(["rollout-chunks", "--quick"])["rollout-chunks"]
    for name, ks in (("demo-long", rollout.QUICK["chunks"]["demo"]), ("full-batch", rollout.QUICK["chunks"]["full"])):
        rows = {r["side"]: r for r in results if r["workload"] == name}
        assert list(rows) == ["static", *(f"K={k}" for k in ks)]
        default = rows[f"K={rows['static']['default_chunk']}"]
        assert default["vs_default"] == 1.0 and all(r["seconds"] > 0 for r in rows.values())
