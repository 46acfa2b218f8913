"""Compute and data-use accounting, on hand-made batches."""

import json
import math

import numpy as np
import pytest

from jaxreplay.config import load_config
from jaxreplay.replay.reader import reader_for
from jaxreplay.replay.server import serve
from jaxreplay.replay.tables import build_tables
from jaxreplay.replay.writer import writer_for
from jaxreplay.train.accounting import STALENESS_EDGES, STALENESS_LABELS, Accounting, histogram


def _items(n, tokens_each, ids=None):
    mask = np.zeros((n, 8), bool)
    mask[:, :tokens_each] = True
    ids = np.arange(n) if ids is None else np.asarray(ids)
    return {"reward": np.zeros(n, np.float32), "attention_mask": mask, "rollout_id": ids.astype(np.int32)}


def test_histogram_bins_are_half_open_with_an_open_last_bin():
    counts = histogram(np.array([0, 1, 2, 3, 4, 7, 8, 300, 1000]), STALENESS_EDGES)
    assert counts == [1, 1, 2, 2, 1, 0, 0, 0, 0, 2]
    assert STALENESS_LABELS[:4] == ("0", "1", "2-3", "4-7") and STALENESS_LABELS[-1] == "256+"


def test_mu_leaves_out_the_compiling_first_calls():
    acc = Accounting(n_params=10, state={})
    acc.on_generate(_items(4, 5), seconds=100.0)  # compile: not timed
    acc.on_generate(_items(4, 5), seconds=2.0)
    acc.on_generate(_items(4, 5), seconds=2.0)
    assert math.isnan(acc.mu)
    acc.on_train(_items(2, 5), np.ones(2), np.zeros(2), seconds=50.0)  # compile
    acc.on_train(_items(2, 5), np.ones(2), np.zeros(2), seconds=0.2)
    # 4 s / 8 rollouts generating vs 0.2 s / 2 rollouts training: mu = 0.5 / 0.1.
    assert acc.generate_s_per_rollout == pytest.approx(0.5)
    assert acc.train_s_per_rollout == pytest.approx(0.1)
    assert acc.mu == pytest.approx(5.0)


def test_flops_count_2n_per_generated_token_and_6n_per_trained_token():
    acc = Accounting(n_params=1000, state={})
    acc.on_generate(_items(3, 4), seconds=1.0)
    m = acc.on_train(_items(2, 5), np.ones(2), np.zeros(2), seconds=1.0)
    assert m["compute/flops_generate"] == 2 * 1000 * 12
    assert m["compute/flops_train"] == 6 * 1000 * 10
    assert m["compute/flops"] == 2 * 1000 * 12 + 6 * 1000 * 10


def test_never_sampled_share_counts_first_samples_only():
    acc = Accounting(n_params=1, state={})
    acc.on_generate(_items(10, 1), seconds=1.0)
    # 4 rows of 3 rollouts: rollout 5 twice in one batch.
    m = acc.on_train(_items(4, 1, ids=[5, 6, 5, 7]), np.array([1, 1, 2, 1]), np.array([0, 3, 9, 0]), seconds=1.0)
    assert m["replay/never_sampled_frac"] == pytest.approx(0.7)
    assert m["staleness/hist"][:5] == [2, 0, 1, 0, 1]
    assert m["replay/times_sampled_hist"][:2] == [3, 1]
    m = acc.on_train(_items(2, 1, ids=[6, 8]), np.array([2, 1]), np.array([0, 0]), seconds=1.0)
    assert m["replay/never_sampled_frac"] == pytest.approx(0.6)


def test_counters_live_in_the_given_dict_so_a_resume_continues_them():
    state = {}
    Accounting(n_params=1, state=state).on_generate(_items(5, 1), seconds=1.0)
    resumed = Accounting(n_params=1, state=dict(state))
    resumed.on_generate(_items(5, 1), seconds=1.0)
    assert resumed.state["rollouts_generated"] == 10


def test_episode_errors_are_run_totals_that_a_resume_continues_and_only_multi_turn_runs_report():
    kinds = ("exception", "timeout")
    state = {}
    first = Accounting(n_params=1, state=state, episode_errors=kinds)
    first.on_episodes({"exception": 3})
    first.on_episodes({"exception": 1, "timeout": 2})
    resumed = Accounting(n_params=1, state=json.loads(json.dumps(state)), episode_errors=kinds)  # as checkpointed
    resumed.on_episodes({"exception": 4})
    totals = {k: v for k, v in resumed.metrics().items() if k.startswith("env/")}
    assert totals == {"env/errors_total/exception": 8, "env/errors_total/timeout": 2}
    assert not any(k.startswith("env/") for k in Accounting(n_params=1, state={}).metrics())


def test_a_resumed_run_leaves_out_its_first_calls_too_since_they_compile_again():
    state = {}
    first = Accounting(n_params=1, state=state)
    first.on_generate(_items(4, 1), seconds=100.0)  # compile
    first.on_generate(_items(4, 1), seconds=2.0)
    first.on_train(_items(2, 1), np.ones(2), np.zeros(2), seconds=50.0)  # compile
    first.on_train(_items(2, 1), np.ones(2), np.zeros(2), seconds=1.0)
    resumed = Accounting(n_params=1, state=dict(state))
    resumed.on_generate(_items(4, 1), seconds=80.0)  # compiles again in the new process
    resumed.on_generate(_items(4, 1), seconds=2.0)
    resumed.on_train(_items(2, 1), np.ones(2), np.zeros(2), seconds=40.0)
    m = resumed.on_train(_items(2, 1), np.ones(2), np.zeros(2), seconds=1.0)
    assert m["time/generate_timed_s"] == pytest.approx(4.0) and m["time/train_timed_s"] == pytest.approx(2.0)
    assert m["rollouts/generated"] == 16 and m["rollouts/trained"] == 8
    assert resumed.mu == pytest.approx((4.0 / 8) / (2.0 / 4))


def test_sampled_ids_survive_a_resume_as_ranges():
    state = {}
    first = Accounting(n_params=1, state=state)
    first.on_generate(_items(10, 1), seconds=1.0)
    first.on_train(_items(5, 1, ids=[0, 1, 2, 7, 8]), np.ones(5), np.zeros(5), seconds=1.0)
    assert state["sampled_id_ranges"] == [[0, 3], [7, 9]]
    resumed = Accounting(n_params=1, state=json.loads(json.dumps(state)))  # as the checkpoint's JSON holds it
    m = resumed.on_train(_items(3, 1, ids=[2, 3, 8]), np.ones(3), np.zeros(3), seconds=1.0)
    assert m["replay/never_sampled_frac"] == pytest.approx(0.4)  # 0-3, 7, 8: 6 of 10 rollouts


def test_never_sampled_share_is_the_rows_own_under_positive_bias():
    """A rollout with reward > 0 has an item in each table, each counting its own samples: the
    share must count rollouts, as the sampled rows' ids say (it went negative counting items)."""
    config = load_config(None, ["replay.max_size=40", "replay.positive_fraction=0.5", "replay.min_size_to_sample=4",
                                "replay.samples_per_insert=2", "replay.error_buffer=1000", "train.batch_size=8",
                                "replay.backend=inprocess", "replay.timeout_s=10"])
    spec = {"reward": ((), np.float32), "attention_mask": ((8,), np.bool_), "rollout_id": ((), np.int32),
            "advantage": ((), np.float32), "policy_version": ((), np.int32)}
    acc, sampled = Accounting(n_params=1, state={}), set()
    with serve(build_tables(config, spec), seed=0) as server:
        writer, reader = writer_for(server, config, spec), reader_for(server, config)
        for step in range(12):
            rows = {**_items(8, 1, ids=np.arange(8 * step, 8 * step + 8)),
                    "reward": np.tile(np.float32([1, 0, 0, 0]), 2), "advantage": np.zeros(8, np.float32),
                    "policy_version": np.full(8, step, np.int32)}
            writer.insert(rows)
            acc.on_generate(rows, seconds=1.0)
            if reader.can_sample(8):
                batch, info = reader.sample(8)
                m = acc.on_train(batch, info.times_sampled, np.zeros(8), seconds=1.0)
                sampled |= set(batch["rollout_id"].tolist())
    truth = 1 - len(sampled) / 96
    assert 0 < truth < 1 and m["replay/never_sampled_frac"] == pytest.approx(truth)
