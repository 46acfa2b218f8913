"""replay.max_times_sampled in replay mode: batches assembled row by row, so deletions never stall."""

from pathlib import Path

import numpy as np
import pytest

from jaxreplay.config import load_config
from jaxreplay.replay.reader import IncrementalReader, reader_for
from jaxreplay.replay.server import serve
from jaxreplay.replay.tables import build_tables
from jaxreplay.replay.writer import writer_for
from jaxreplay.train.driver import train
from jaxreplay.train.metrics import read_metrics

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
SPEC = {"tokens": ((3,), np.int32), "attention_mask": ((3,), np.bool_), "completion_mask": ((3,), np.bool_),
        "logprobs": ((3,), np.float32), "advantage": ((), np.float32), "reward": ((), np.float32),
        "policy_version": ((), np.int32)}  # policy_version doubles as the row id


def _rows(ids):
    n = len(ids)
    return {"tokens": np.zeros((n, 3), np.int32), "attention_mask": np.ones((n, 3), bool),
            "completion_mask": np.ones((n, 3), bool), "logprobs": np.zeros((n, 3), np.float32),
            "advantage": np.zeros(n, np.float32), "reward": np.zeros(n, np.float32),
            "policy_version": np.asarray(ids, np.int32)}


@pytest.mark.tier
@pytest.mark.timeout(60, method="thread")
def test_a_batch_is_assembled_from_what_can_be_taken_without_blocking():
    c = load_config(None, ["replay.max_times_sampled=1", "replay.min_size_to_sample=4", "replay.max_size=64",
                           "train.batch_size=8", "replay.samples_per_insert=1", "replay.timeout_s=10"])
    with serve(build_tables(c, SPEC), timeout_s=10) as server:
        writer, reader = writer_for(server, c, SPEC), reader_for(server, c)
        assert isinstance(reader, IncrementalReader)
        writer.insert(_rows(range(6)))
        # 6 rows, each deleted when sampled: at most 6 - 4 + 1 = 3 can go before the table dips below 4.
        assert reader.sample(8) == (None, None) and reader.pending_rows == 3
        assert not reader.can_sample(8)  # 3 rows left, below min_size_to_sample: only an insert helps
        writer.insert(_rows(range(6, 12)))
        batch, info = reader.sample(8)
        assert batch is not None and len(batch["policy_version"]) == 8 and reader.pending_rows == 0
        assert len(set(batch["policy_version"].tolist())) == 8  # sampled once each: no row twice
        assert (info.times_sampled == 1).all()


@pytest.mark.tier
@pytest.mark.slow
def test_training_with_sample_once_and_a_higher_target_ratio_never_stalls(tmp_path):
    # spi 2 > max_times_sampled 1: the limiter owes samples the table cannot give, the worst case.
    config = load_config(DEMO, [
        "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
        "model.d_ff=64", "task.eval_size=32", "warmstart.steps=2", "train.batch_size=16",
        "train.prompts_per_step=4", "train.group_size=4", "train.eval_every=4", "replay.max_size=64",
        "replay.min_size_to_sample=32", "checkpoint.every=4", "run.progress_bar=false", "train.steps=12",
        "replay.max_times_sampled=1", "replay.samples_per_insert=2", "replay.timeout_s=20", f"run.dir={tmp_path}"])
    summary = train(config, log=lambda _: None)
    assert summary["steps"] == 12
    records = [r for r in read_metrics(tmp_path) if r["step"] > 0]
    assert all(r["replay/times_sampled_hist"][0] == 16 for r in records)  # every row sampled for the first time
    assert summary["replay/ratio"] <= 1.0  # each rollout at most once, whatever the target
