"""Sampling policies against a real Reverb server: positive bias (what each table keeps, how batches
split) and prioritized replay (priorities from the frozen advantage)."""

import numpy as np
import pytest

reverb = pytest.importorskip("reverb", reason="needs dm-reverb (the `reverb` extra; Python 3.10/3.11)")

from jaxreplay.config import ConfigError, load_config
from jaxreplay.replay.reader import PositiveBiasReader, reader_for
from jaxreplay.replay.reverb_backend import ReverbServer
from jaxreplay.replay.rows import RowLayout
from jaxreplay.replay.tables import POSITIVE_TABLE_NAME, TABLE_NAME, build_tables, positive_split
from jaxreplay.replay.writer import writer_for

pytestmark = [pytest.mark.needs_reverb, pytest.mark.timeout(60, method="thread")]

SPEC = {"tokens": ((3,), np.int32), "attention_mask": ((3,), np.bool_), "completion_mask": ((3,), np.bool_),
        "logprobs": ((3,), np.float32), "advantage": ((), np.float32), "reward": ((), np.float32),
        "policy_version": ((), np.int32)}  # policy_version doubles as the row id


def _rows(ids, correct):
    ids = np.asarray(ids)
    return {"tokens": np.repeat(ids[:, None], 3, 1).astype(np.int32), "attention_mask": np.ones((len(ids), 3), bool),
            "completion_mask": np.ones((len(ids), 3), bool), "logprobs": np.zeros((len(ids), 3), np.float32),
            "advantage": np.zeros(len(ids), np.float32),
            "reward": np.array([float(correct(i)) for i in ids], np.float32), "policy_version": ids.astype(np.int32)}


def _config(**extra):
    overrides = {"replay.max_size": 30, "replay.positive_fraction": 0.34, "replay.min_size_to_sample": 4,
                 "replay.samples_per_insert": 1, "replay.error_buffer": 1000, "train.batch_size": 8,
                 "replay.timeout_s": 10, **extra}
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


LAYOUT = RowLayout(SPEC)  # a Reverb item is one packed row


def _row_id(sample) -> int:
    """The id of a row sampled with Reverb's own client."""
    return int(LAYOUT.unpack(sample.data[0][None])["policy_version"][0])


def _ids_in(server, table, draws=600):
    """Every row id in `table`: uniform draws with replacement find all of <= 30 rows (miss odds < 1e-9)."""
    client = reverb.Client(server.address)
    return {_row_id(s) for s in client.sample(table, draws, emit_timesteps=False)}


def test_split_divides_window_and_batch_in_proportion_and_keeps_the_overall_ratio():
    s = positive_split(load_config(None, ["replay.positive_fraction=0.5", "replay.samples_per_insert=4"]))
    assert (s.main_size, s.positive_size, s.main_batch, s.positive_batch) == (256, 256, 32, 32)
    assert s.main_samples_per_insert == 2.0  # 32 from main per 64 trained: each insert still trained on 4 times
    off = positive_split(load_config(None))
    assert (off.main_size, off.positive_size, off.main_batch) == (512, 0, 64)


def test_positives_table_keeps_the_freshest_correct_rollouts():
    c = _config()
    with ReverbServer(build_tables(c, SPEC, "reverb"), timeout_s=10) as server:
        writer_for(server, c, SPEC).insert(_rows(range(40), correct=lambda i: i % 3 == 0))
        assert server.states()[POSITIVE_TABLE_NAME].max_size == 10
        # Rollout table: the freshest 30 - 10 = 20 of all rows. Positives: the freshest 10 correct ones.
        assert _ids_in(server, TABLE_NAME) == set(range(20, 40))
        assert _ids_in(server, POSITIVE_TABLE_NAME) == set(range(12, 40, 3))


def test_batches_take_their_positive_share_once_a_correct_rollout_exists():
    c = _config()
    with ReverbServer(build_tables(c, SPEC, "reverb"), timeout_s=10) as server:
        writer, reader = writer_for(server, c, SPEC), reader_for(server, c)
        assert isinstance(reader, PositiveBiasReader)
        writer.insert(_rows(range(10), correct=lambda i: False))
        batch, info = reader.sample(8)  # no correct rollout yet: all 8 from the rollout table
        assert len(info.keys) == 8 and not batch["reward"].any()
        writer.insert(_rows([10], correct=lambda i: True))
        assert [n for _, n in reader.split(8)] == [5, 3]  # round(0.34 * 8) = 3 from the positives
        batch, _ = reader.sample(8)
        assert batch["reward"][5:].tolist() == [1.0, 1.0, 1.0]
        assert set(batch["policy_version"][5:]) == {10}


def test_positive_fraction_is_validated():
    with pytest.raises(ConfigError, match="replay.positive_fraction"):
        load_config(None, ["replay.positive_fraction=1"])
    with pytest.raises(ConfigError, match="replay.positive_fraction"):
        load_config(None, ["replay.positive_fraction=0.9"])  # leaves 51 rows < min_size_to_sample 128


def test_prioritized_selector_samples_in_proportion_to_absolute_advantage():
    c = load_config(None, ["replay.selector=prioritized", "replay.priority_exponent=1", "replay.min_size_to_sample=2",
                           "replay.max_size=64", "train.batch_size=8", "replay.error_buffer=1000"])
    rows = _rows([0, 1, 2], correct=lambda i: False)
    rows["advantage"] = np.array([0.0, 1.0, -3.0], np.float32)  # priorities 0.001, 1.001, 3.001
    with ReverbServer(build_tables(c, SPEC, "reverb"), timeout_s=10) as server:
        writer_for(server, c, SPEC).insert(rows)
        samples = list(reverb.Client(server.address).sample(TABLE_NAME, 1000, emit_timesteps=False))
    ids = np.array([_row_id(s) for s in samples])
    probability = {int(i): p for i, p in zip(ids, [s.info.probability for s in samples])}
    assert probability[2] == pytest.approx(3.001 / 4.003) and probability[1] == pytest.approx(1.001 / 4.003)
    assert (ids == 0).mean() < 0.01
