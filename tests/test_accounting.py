"""Compute and data-use accounting, on hand-made batches."""

import math

import numpy as np
import pytest

from jaxreplay.accounting import STALENESS_EDGES, STALENESS_LABELS, Accounting, histogram


def _items(n, tokens_each):
    mask = np.zeros((n, 8), bool)
    mask[:, :tokens_each] = True
    return {"reward": np.zeros(n, np.float32), "attention_mask": mask}


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
    # 4 rows, of which 3 are first samples (times_sampled == 1) and 1 a replay of one of them.
    m = acc.on_train(_items(4, 1), np.array([1, 1, 2, 1]), np.array([0, 3, 9, 0]), seconds=1.0)
    assert m["replay/never_sampled_frac"] == pytest.approx(0.7)
    assert m["staleness/hist"][:5] == [2, 0, 1, 0, 1]
    assert m["replay/times_sampled_hist"][:2] == [3, 1]


def test_counters_live_in_the_given_dict_so_a_resume_continues_them():
    state = {}
    Accounting(n_params=1, state=state).on_generate(_items(5, 1), seconds=1.0)
    resumed = Accounting(n_params=1, state=dict(state))
    resumed.on_generate(_items(5, 1), seconds=1.0)
    assert resumed.state["rollouts_generated"] == 10


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
