"""skyrl-gym's environments through their own API behind the multi-turn protocol (tasks/skyrl_env.py)."""

import pytest

from jaxreplay.tasks.arithmetic import Problem
from jaxreplay.tasks.environment import Message, make_environment

pytestmark = pytest.mark.needs_skyrl


@pytest.fixture(scope="module", autouse=True)
def adapter():
    import jaxreplay.tasks.skyrl_env  # noqa: F401 - registers `skyrl`


def test_multi_turn_gsm8k_asks_again_until_the_answer_is_right():
    env = make_environment("skyrl", {"max_turns": 3})
    first = env.reset(Problem(12, "*", 34, width=2), seed=0)
    assert first == (Message("user", "12*34="),)
    step = env.step("I think it is #### 407")
    assert not step.done and 0 < step.reward < 1  # skyrl-gym's format score: well formed, wrong
    assert step.observation[0].role == "user" and "#### ANSWER" in step.observation[0].content
    step = env.step("#### 408")
    assert step.done and step.reward == 1.0 and step.observation == ()


def test_an_episode_ends_at_max_turns_and_a_fresh_reset_starts_over():
    env = make_environment("skyrl", {"max_turns": 2})
    env.reset({"question": "1+1=", "answer": "2"}, seed=0)
    assert not env.step("no idea").done
    last = env.step("3")
    assert last.done and last.reward == 0.0
    env.reset({"question": "2+2=", "answer": "4"}, seed=1)
    assert env.step("#### 4").reward == 1.0


def test_code_executing_environments_are_refused_by_default():
    with pytest.raises(ValueError, match="no sandbox"):
        make_environment("skyrl", {"env": "lcb"})
    with pytest.raises(ValueError, match="has no environment"):
        make_environment("skyrl", {"env": "chess"})


def test_skyrl_runs_in_a_worker_process_by_its_import_name():
    from jaxreplay.tasks.environment import EnvPool
    pool = EnvPool("jaxreplay.tasks.skyrl_env:SkyRLEnvironment", {"max_turns": 2}, workers=1, processes=True,
                   timeout=60)
    try:
        env = pool.create()
        assert pool.reset([env], ("6*7=", "42"), seed=0) == [(Message("user", "6*7="),)]
        pool.step(env, "#### 42")
        got = []
        while not got:
            got = pool.results(60)
        assert got[0][1].done and got[0][1].reward == 1.0
    finally:
        pool.shutdown()
