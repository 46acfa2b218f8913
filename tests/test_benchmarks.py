"""The benchmark entry point runs end to end (tiny sizes), so it cannot rot."""

import json

import pytest

from benchmarks import run

# Both benchmarks compare against transformers' torch models on the same weights.
pytest.importorskip("torch", reason="the 'parity' extra (CPU torch) is not installed")


def test_quick_benchmark_writes_every_figure(tmp_path):
    out = tmp_path / "results.json"
    results = run.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()).keys() == results.keys()
    for row in results["sampler"]:
        assert row["ours_tok_s"] > 0 and row["generate_tok_s"] > 0 and row["compile_s"] > 0
    assert results["learner"]["tokens_s"] > 0 and 0 <= results["learner"]["outside_share"] < 1
    assert results["replay"]["insert_items_s"] > 0 and results["replay"]["sample_items_s"] > 0
    assert results["demo"]["steps"] == 3 and 0 < results["demo"]["replay_share_of_loop"] < 1  # 4, 1 for warm-up
    assert [r["items"] for r in results["scaling"]["rows"]] == [100, 1000]
    assert "sampler/generate" in run.table(results)

