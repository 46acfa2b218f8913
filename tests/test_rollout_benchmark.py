"""`python -m benchmarks.run rollout --quick` runs end to end (tiny sizes), so it cannot rot."""

import json

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
