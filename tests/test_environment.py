"""The environment worker pool: inline, threads and processes; an environment that raises or
blocks ends its episode with a counted error, never the run."""

import time

import pytest

from jaxreplay.tasks.environment import EnvPool, Message, make_environment
from jaxreplay.tasks.guess import GuessDigit, play

import numpy as np


def _episode(pool: EnvPool, turns: int = 5, wait: float = 5.0):
    """Steps one instance until done; the Steps it got."""
    env = pool.create()
    assert pool.reset([env], item=0, seed=0) == [(Message("user", ":"),)]
    steps = []
    for _ in range(turns):
        pool.step(env, "1")
        got = []
        while not got:
            got = pool.results(wait)
        assert [i for i, _ in got] == [env]
        steps.append(got[0][1])
        if steps[-1].done:
            break
    pool.close(env)
    return steps


@pytest.mark.parametrize("workers,processes", [(0, False), (2, False)])
def test_steps_run_until_done(workers, processes):
    pool = EnvPool("mt_envs:Echo", {"turns": 3}, workers=workers, processes=processes, timeout=5)
    steps = _episode(pool)
    assert [s.done for s in steps] == [False, False, True] and steps[-1].reward == 3.0
    pool.shutdown()


@pytest.mark.parametrize("workers,processes", [(0, False), (2, False), (1, True)])
def test_an_exception_ends_the_episode_counted(workers, processes):
    pool = EnvPool("mt_envs:Echo", {"turns": 5, "raise_at": 2}, workers=workers, processes=processes, timeout=30)
    steps = _episode(pool)
    assert len(steps) == 2 and steps[-1].done and steps[-1].info["error"] == "exception"
    pool.shutdown()


def test_a_blocked_thread_step_times_out():
    pool = EnvPool("mt_envs:Echo", {"turns": 5, "hang_at": 1, "sleep": 0}, workers=2, timeout=0.3)
    start = time.monotonic()
    steps = _episode(pool)
    assert steps[-1].info["error"] == "timeout" and time.monotonic() - start < 5
    pool.shutdown()


def test_a_blocked_process_is_killed_restarted_and_the_pool_goes_on():
    pool = EnvPool("mt_envs:Echo", {"turns": 2, "hang_at": 1}, workers=1, processes=True, timeout=2)
    steps = _episode(pool)
    assert steps[-1].info["error"] == "timeout"
    # the restarted worker serves a fresh instance (whose first step hangs too: it is the same class),
    # so the instance after it uses options where nothing hangs
    pool.shutdown()
    pool = EnvPool("mt_envs:Echo", {"turns": 2}, workers=1, processes=True, timeout=5)
    assert [s.done for s in _episode(pool)] == [False, True]
    pool.shutdown()


def test_guess_digit_answers_and_needs_them():
    env = make_environment("guess_digit")
    assert env.reset(7, 0) == (Message("user", ":"),)
    assert env.step("4").observation == (Message("user", "+"),)
    assert env.step("8").observation == (Message("user", "-"),)
    last = env.step("7")
    assert last.done and last.reward == 1.0
    env.reset(3, 0)
    assert env.step("x5").info["error"] == "malformed_tool_call"


def test_bisection_always_wins_a_sloppy_player_sometimes_not():
    rng = np.random.default_rng(0)
    assert all(play(d, rng, 0.0)[-1][1] == "" and int(play(d, rng, 0.0)[-1][0]) == d for d in range(10))
    wins = np.mean([int(play(d % 10, rng, 1.0)[-1][0]) == d % 10 for d in range(400)])
    assert 0.2 < wins < 0.6
    assert isinstance(GuessDigit().reset(1, 0)[0], Message)
