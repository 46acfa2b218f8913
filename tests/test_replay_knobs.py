"""The freshness knobs on real tables (docs/comparing.md, "Replay knobs"): max_age evictions, fresh anchors,
freshness-decayed priorities, dropping zero-advantage groups; each off by default, measured
as ages, fractions and priorities of what the tables hand out."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxreplay.config import ConfigError, load_config
from jaxreplay.replay.limiter import LimiterState, age_shortfall, next_move
from jaxreplay.replay.reader import reader_for
from jaxreplay.replay.server import serve
from jaxreplay.replay.tables import FRESH_TABLE_NAME, TABLE_NAME
from jaxreplay.replay.tables import build_tables
from jaxreplay.replay.writer import writer_for
from jaxreplay.rollout import rollouts

pytestmark = pytest.mark.timeout(120, method="thread")

BACKENDS = ["inprocess", pytest.param("reverb", marks=pytest.mark.needs_reverb)]
SPEC = {"advantage": ((), np.float32), "reward": ((), np.float32), "policy_version": ((), np.int32),
        "rollout_id": ((), np.int32)}


def _config(backend="inprocess", **extra):
    overrides = {"replay.backend": backend, "replay.max_size": 64, "replay.min_size_to_sample": 8,
                 "replay.samples_per_insert": 2, "train.batch_size": 8, "train.prompts_per_step": 2,
                 "train.group_size": 4, "replay.timeout_s": 10, **extra}
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def _rows(version, n, first_id, advantage=1.0):
    return {"advantage": np.full(n, advantage, np.float32), "reward": np.ones(n, np.float32),
            "policy_version": np.full(n, version, np.int32), "rollout_id": np.arange(first_id, first_id + n, dtype=np.int32)}


# --- the protocol's delete, and eviction by policy version ------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_deleted_items_leave_the_table_and_count_as_deletions(backend):
    config = _config(backend, **{"replay.selector": "fifo", "replay.min_size_to_sample": 4})
    with serve(build_tables(config, SPEC), seed=0) as server:
        writer_for(server, config, SPEC).insert(_rows(0, 8, 0))
        _, info = reader_for(server, config).sample(2)  # fifo: rows 0 and 0 again (nothing deleted yet)
        server.delete(TABLE_NAME, info.keys[:1])
        server.delete(TABLE_NAME, info.keys[:1])  # a key no longer there is skipped
        state = server.states()[TABLE_NAME]
        assert (state.size, state.deletes, state.inserts, state.samples) == (7, 1, 8, 2)
        batch, _ = reader_for(server, config).sample(1)
        assert batch["rollout_id"].tolist() == [1]  # fifo: the oldest left


def test_evict_deletes_the_rows_of_older_versions_from_the_table_asked():
    config = _config(**{"replay.error_buffer": 1000})
    with serve(build_tables(config, SPEC), seed=0) as server:
        writer = writer_for(server, config, SPEC)
        for v in range(6):
            writer.insert(_rows(v, 4, 4 * v))
        assert server.evict(TABLE_NAME, 4) == 16
        state = server.states()[TABLE_NAME]
        assert (state.size, state.deletes) == (8, 16)
        batch, _ = reader_for(server, config).sample(8)
        assert set(batch["policy_version"].tolist()) <= {4, 5}


def test_max_age_is_refused_where_the_backend_cannot_find_stale_items():
    with pytest.raises(ConfigError, match="replay.max_age: needs replay.backend=inprocess"):
        _config("reverb", **{"replay.max_age": 8})


# --- max_age: the limiter rule, on a real table driven by the scheduler ------------------------------

def _simulate(config, steps=40):
    """The colocated turn schedule on a real in-process table, evicting before every move as the
    driver does; returns (the age of every sampled row, the measured ratio, actor steps)."""
    r, b = config.rollouts_per_step, config.train.batch_size
    ages, version, pending, acts = [], 0, None, 0
    with serve(build_tables(config, SPEC), seed=0) as server:
        writer, reader = writer_for(server, config, SPEC), reader_for(server, config)
        while version < steps:
            if config.replay.max_age and version - config.replay.max_age > 0:
                server.evict(TABLE_NAME, version - config.replay.max_age)
            state = server.states()[TABLE_NAME]
            move = next_move(state, rollouts.count(pending), reader.can_sample(b))
            if move.kind == "insert":
                head, pending = rollouts.split(pending, move.rows)
                writer.insert(head)
            elif move.kind == "learn":
                batch, _ = reader.sample(b)
                ages.extend(version - batch["policy_version"])
                version += 1
            else:
                pending, acts = _rows(version, r, acts * r), acts + 1
        return np.array(ages), server.states()[TABLE_NAME].ratio, acts


def test_max_age_within_the_rule_never_samples_an_older_row_and_keeps_the_ratio():
    config = _config(**{"replay.max_age": 1})  # (1 + 1) * 8 / 2 = 8 young rows = min_size_to_sample
    ages, ratio, acts = _simulate(config)
    assert ages.max() <= 1 and 0 in ages
    assert ratio == pytest.approx(2, rel=0.1)
    off_ages, _, off_acts = _simulate(_config())
    assert off_ages.max() > 1 and off_acts == pytest.approx(acts, abs=2)  # eviction costs no extra generation


def test_max_age_below_the_rule_is_refused_and_would_lose_the_ratio():
    valid = _config(**{"replay.min_size_to_sample": 24})
    config = dataclasses.replace(valid, replay=dataclasses.replace(valid.replay, max_age=3))  # 4 * 8 / 2 = 16 < 24
    why = age_shortfall(config)
    assert why and "raise it to at least 5" in why  # (5 + 1) * 4 = 24
    with pytest.raises(ConfigError, match="replay.max_age: 3 keeps about"):
        _config(**{"replay.max_age": 3, "replay.min_size_to_sample": 24, "replay.backend": "inprocess"})
    # What the rule prevents: evictions keep the table under min_size_to_sample, so fresh acts are
    # admitted past the ratio and many more rollouts are generated per learner step.
    _, ratio, acts = _simulate(config)
    _, ratio_ok, acts_ok = _simulate(_config(**{"replay.max_age": 5, "replay.min_size_to_sample": 24}))
    assert ratio < 0.75 * ratio_ok and acts > 1.3 * acts_ok


def test_max_age_rules_for_the_other_placements():
    with pytest.raises(ConfigError, match="weight_sync_every - 1 = 3"):
        _config(**{"replay.max_age": 2, "mesh.actor_devices": 1, "train.weight_sync_every": 4})
    with pytest.raises(ConfigError, match="replay.mode"):
        _config(**{"replay.max_age": 2, "replay.mode": "on_policy"})
    with pytest.raises(ConfigError, match="replay.max_age: evictions are not supported multi-host"):
        _config(**{"replay.max_age": 2, "distributed.enabled": "true", "distributed.num_processes": 2,
                   "distributed.process_id": 0, "distributed.coordinator_address": "localhost:1234"})


# --- fresh anchors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_fresh_rows_of_every_batch_come_from_the_newest_actor_step(backend):
    config = _config(backend, **{"replay.fresh_fraction": 0.25})  # round(0.25 * 8) = 2 of every 8
    r = config.rollouts_per_step
    with serve(build_tables(config, SPEC), seed=0) as server:
        writer, reader = writer_for(server, config, SPEC), reader_for(server, config)
        fresh_share, main_samples = [], 0
        for step in range(12):
            writer.insert(_rows(step, r, step * r))
            while reader.can_sample(8):
                batch, _ = reader.sample(8)
                newest = batch["policy_version"] == step
                assert newest[-2:].all()  # the fresh rows come last
                fresh_share.append(newest.mean())
                main_samples += 6
        state = server.states()
        assert state[TABLE_NAME].samples == main_samples  # the limiter counts the main table's rows only
        assert state[TABLE_NAME].samples_per_insert == pytest.approx(2 * 6 / 8)
        assert state[FRESH_TABLE_NAME].size == r
    assert min(fresh_share) >= 0.25


def test_fresh_fraction_is_validated():
    with pytest.raises(ConfigError, match="replay.fresh_fraction: must be in"):
        _config(**{"replay.fresh_fraction": 1})
    with pytest.raises(ConfigError, match="leaves no row of a batch of 8"):
        _config(**{"replay.fresh_fraction": 0.5, "replay.positive_fraction": 0.5})
    with pytest.raises(ConfigError, match="replay.fresh_fraction: cannot be combined with replay.max_times_sampled"):
        _config(**{"replay.fresh_fraction": 0.25, "replay.max_times_sampled": 2})


# --- freshness-decayed priorities ----------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_decayed_priorities_weigh_each_row_by_decay_to_its_age(backend):
    config = _config(backend, **{"replay.selector": "prioritized", "replay.priority_decay": 0.5,
                                 "replay.priority_exponent": 1.0, "replay.error_buffer": 1000})
    with serve(build_tables(config, SPEC), seed=0) as server:
        writer = writer_for(server, config, SPEC)
        for v in range(4):
            writer.insert(_rows(v, 4, 4 * v, advantage=1.0 if v % 2 else 2.0))  # base priority 2.001 or 1.001
        batch, info = reader_for(server, config).sample(512)
    base = np.abs(batch["advantage"].astype(np.float64)) + 1e-3
    age = 3 - batch["policy_version"]  # the newest rows are version 3
    weight = base * 0.5 ** age
    total = 4 * sum((2.001 if v % 2 == 0 else 1.001) * 0.5 ** (3 - v) for v in range(4))
    np.testing.assert_allclose(info.probabilities, weight / total, rtol=1e-6)
    # Drawn as weighted: the newest rows hold 4 * 1.001 / total = 0.40 of the weight (0.17 without the
    # decay). Reverb's draws are not seeded: 0.1 is 4.6 standard deviations of the share in 512 draws.
    assert abs((batch["policy_version"] == 3).mean() - 4 * 1.001 / total) < 0.1


def test_priority_decay_is_validated():
    with pytest.raises(ConfigError, match="needs replay.selector=prioritized"):
        _config(**{"replay.priority_decay": 0.9})
    with pytest.raises(ConfigError, match="must be in \\(0, 1\\]"):
        _config(**{"replay.priority_decay": 0, "replay.selector": "prioritized"})
    with pytest.raises(ConfigError, match="overflows the stored priorities.*at most 5463 steps"):
        _config(**{"replay.priority_decay": 0.9, "replay.selector": "prioritized", "train.steps": 6000})


# --- dropping zero-advantage groups ----------------------------------------------------------------------

def test_groups_whose_advantages_are_all_zero_are_dropped_whole():
    rows = _rows(0, 12, 0)
    rows["advantage"] = np.float32([0, 0, 0, 0, 1, -1, 0, 0, 0, 0, 0, 0])
    kept, dropped = rollouts.drop_flat_groups(rows, 4)
    assert dropped == 2 and kept["rollout_id"].tolist() == [4, 5, 6, 7]
    rows["advantage"][:] = 0
    assert rollouts.drop_flat_groups(rows, 4) == (None, 3)  # a whole actor batch: the next move is act
    empty = LimiterState(TABLE_NAME, 0, 64, 0, 0, 0, 0, 2.0, 8, 6.0, 26.0)
    assert next_move(empty, pending=0, can_learn=False).kind == "act"


# --- end to end: real training runs (colocated, in-process table) ------------------------------------

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
        "model.d_ff=64", "task.eval_size=32", "train.batch_size=16", "train.prompts_per_step=4",
        "train.group_size=4", "train.eval_every=4", "replay.max_size=64", "replay.min_size_to_sample=32",
        "checkpoint.every=4", "run.progress_bar=false", "replay.backend=inprocess"]
# One-digit sums after a longer warm start: many groups score alike (all right), some do not.
LEARNING = ["task.min_digits=1", "task.max_digits=1", "warmstart.steps=300", "warmstart.learning_rate=3e-3"]


def _train(tmp_path, *overrides):
    from jaxreplay.train.driver import train
    from jaxreplay.train.metrics import read_metrics

    config = load_config(None, [*TINY, f"run.dir={tmp_path}", *overrides])
    summary = train(config, log=lambda _: None)
    return config, summary, read_metrics(config.run.dir)[1:]


@pytest.mark.slow
def test_a_run_with_max_age_never_trains_on_older_rows_and_drops_flat_groups(tmp_path):
    config, summary, records = _train(tmp_path, *LEARNING, "train.steps=10", "replay.max_age=3",
                                      "replay.drop_zero_advantage_groups=true")
    assert summary["steps"] == 10
    assert max(r["staleness/max"] for r in records) <= 3
    last = records[-1]
    assert last["replay/evicted"] > 0 and last["replay/dropped_groups"] > 0
    # The limiter counted only what was inserted: generated = inserted + dropped + still waiting.
    waiting = last["rollouts/generated"] - 4 * last["replay/dropped_groups"] - last["replay/inserts"]
    assert 0 <= waiting <= config.rollouts_per_step
    dropped_share = 4 * last["replay/dropped_groups"] / last["rollouts/generated"]
    assert last["replay/never_sampled_frac"] >= dropped_share


@pytest.mark.slow
def test_a_run_with_fresh_anchors_and_decayed_priorities_keeps_the_limiter_on_the_main_table(tmp_path):
    config, summary, records = _train(tmp_path, "warmstart.steps=10", "train.steps=8", "replay.selector=prioritized",
                                      "replay.priority_decay=0.8", "replay.fresh_fraction=0.25")
    assert summary["steps"] == 8
    assert records[-1]["replay/samples"] == 8 * (16 - 4)  # the 4 fresh rows of each batch are outside the limiter


@pytest.mark.slow
def test_a_run_whose_every_group_is_dropped_acts_again_and_ends_after_the_timeout(tmp_path):
    """Without a warm start every reward is 0: each actor step is dropped whole, the next move
    is to act again, and after replay.timeout_s of that the run says why it cannot go on."""
    from jaxreplay.replay.tables import ReplayTimeoutError

    with pytest.raises(ReplayTimeoutError, match="scored alike .* nothing to insert for longer than "
                                                 "replay.timeout_s=2s"):
        _train(tmp_path, "warmstart.steps=0", "train.steps=4", "replay.timeout_s=2",
               "replay.drop_zero_advantage_groups=true")


@pytest.mark.slow
def test_a_run_with_the_knobs_resumes_exactly(tmp_path):
    """3 steps then the same command with train.steps=8 equals 8 straight: the fresh table,
    the evictions and the knobs' counters are all in the checkpoint."""
    knobs = [*LEARNING, "replay.max_age=3", "replay.fresh_fraction=0.25", "replay.drop_zero_advantage_groups=true"]
    _, _, straight = _train(tmp_path / "straight", *knobs, "train.steps=8")
    _train(tmp_path / "resumed", *knobs, "train.steps=3")
    _, _, resumed = _train(tmp_path / "resumed", *knobs, "train.steps=8")
    assert [r["step"] for r in resumed] == list(range(1, 9))
    for a, b in zip(straight, resumed):
        for key in ("loss", "replay/inserts", "replay/samples", "replay/evicted", "replay/dropped_groups",
                    "replay/never_sampled_frac", "staleness/mean", "staleness/max"):
            assert a[key] == pytest.approx(b[key], rel=1e-6), (a["step"], key)
