"""The scheduler's limiter arithmetic: admitted inserts, the next move, the deadlock window."""

import dataclasses

import pytest

from jaxreplay.config import load_config
from jaxreplay.replay.limiter import (
    LimiterState, Move, SchedulerStuckError, admitted_inserts, next_move, sample_room, window_shortfall)

from test_train import DEMO


def _state(inserts: int, samples: int, size: int, spi: float = 1.0, min_size: int = 8,
           window: tuple[float, float] = (-20.0, 20.0)) -> LimiterState:
    return LimiterState(table="rollouts", size=size, max_size=64, max_times_sampled=0, inserts=inserts,
                        samples=samples, deletes=inserts - size, samples_per_insert=spi, min_size_to_sample=min_size,
                        min_diff=window[0], max_diff=window[1])


def test_inserts_are_admitted_for_all_processes_together():
    # diff = 30 - 20 = 10; each row per process adds 2: the window (max 20) admits 5 more each.
    state = _state(inserts=30, samples=20, size=30)
    assert admitted_inserts(state, 16, processes=2) == 5
    assert admitted_inserts(state, 3, processes=2) == 3
    assert admitted_inserts(state, 16) == 10


def _move(state: LimiterState, pending: int) -> Move:
    return next_move(state, pending, state.can_sample_at_once(16), processes=2)


def test_the_next_move_is_insert_then_learn_then_act():
    assert _move(_state(0, 0, 0), pending=4) == Move("insert", 4)
    full = _state(inserts=40, samples=10, size=40, window=(-20.0, 30.0))  # diff 30: no room for inserts
    assert _move(full, pending=4) == Move("learn")
    drained = _state(inserts=16, samples=24, size=16)  # diff -8: a batch of 16 would pass min_diff -20
    assert _move(drained, pending=0) == Move("act")


def test_a_limiter_that_admits_nothing_stops_the_run_naming_its_state():
    with pytest.raises(SchedulerStuckError, match="diff=10"):
        _move(_state(inserts=40, samples=30, size=40, window=(-2.0, 10.0)), pending=4)


def test_sample_room_is_the_largest_batch_taken_without_blocking():
    state = _state(inserts=30, samples=20, size=30)  # diff 10, min_diff -20: 30 samples admitted
    assert sample_room(state, 64) == 30
    assert sample_room(state, 7) == 7
    assert sample_room(_state(inserts=4, samples=0, size=4), 16) == 0  # below min_size_to_sample


@pytest.mark.parametrize("processes, error_buffer, ok", [(1, 10.0, True), (1, 8.0, False), (2, 11.0, False),
                                                          (2, 12.0, True)])
def test_the_window_must_hold_one_batch_plus_one_insert_from_every_process(processes, error_buffer, ok):
    valid = load_config(DEMO, ["train.batch_size=16", "replay.samples_per_insert=4", "replay.mode=replay"])
    config = dataclasses.replace(valid, replay=dataclasses.replace(valid.replay, error_buffer=error_buffer))
    why = window_shortfall(config, processes)
    assert (why is None) == ok
    if not ok:
        assert f"raise it to at least {(16 + processes * 4) / 2:g}" in why
