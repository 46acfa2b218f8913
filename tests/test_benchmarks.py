"""The benchmark entry point runs end to end (tiny sizes), so it cannot rot."""

import json

import pytest

from benchmarks import run
from benchmarks.torch_reference import torch_python

# Both benchmarks compare against transformers' torch models on the same weights; the
# reference may run under another interpreter (the Reverb lane's venv has CPU torch).
TORCH_PYTHON = torch_python()
needs_torch = pytest.mark.skipif(TORCH_PYTHON is None, reason="no interpreter with torch: the 'parity' extra, or "
                                 ".venv-reverb (make test LANE=reverb)")


@needs_torch
def test_quick_benchmark_writes_every_figure(tmp_path):
    out = tmp_path / "results.json"
    results = run.main(["--quick", "--out", str(out), "--torch-python", TORCH_PYTHON])
    assert json.loads(out.read_text()).keys() == results.keys()
    for row in results["sampler"]:
        assert row["ours_tok_s"] > 0 and row["generate_tok_s"] > 0 and row["compile_s"] > 0
    assert results["learner"]["tokens_s"] > 0 and 0 <= results["learner"]["outside_share"] < 1
    assert results["replay"]["insert_items_s"] > 0 and results["replay"]["sample_items_s"] > 0
    assert results["demo"]["steps"] == 3 and 0 < results["demo"]["replay_share_of_loop"] < 1  # 4, 1 for warm-up
    assert [r["items"] for r in results["scaling"]["rows"]] == [100, 1000]
    assert "sampler/generate" in run.table(results)
