"""The multi-turn testbed (issue 55): a hidden number in a range found from `+`/`-` answers. Its
rules, its latency (repeatable from a seed, the declared median), its splits (the sloppy player's
apart from the RL pool, validation and test), a reward that needs the environment's answers, the
warm start's rows, the evaluation on both held-out splits, and a tiny run of its config."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import statistics
import time

import numpy as np
import pytest

from jaxreplay.config import ConfigError, TaskConfig, load_config, validate
from jaxreplay.tasks.arithmetic import CharTokenizer
from jaxreplay.tasks.environment import EnvPool, Message, make_environment
from jaxreplay.tasks.guess_number import MAX_TURNS, MIN_WIDTH, GuessNumber, GuessNumberTask, all_items, play
from jaxreplay.tasks.latency import Latency
from jaxreplay.tasks.scripted import episode_rows

from test_train import ROOT

TESTBED = ROOT / "configs" / "testbed_guess.yaml"


def test_the_environment_answers_higher_lower_and_ends_on_the_number_or_the_seventh_guess():
    env = make_environment("guess_number")
    assert env.reset((14, 83, 20), 0) == (Message("user", "14,83:"),)
    assert env.step("48").observation == (Message("user", "-"),)
    assert env.step("9").observation == (Message("user", "+"),)  # outside the range: a wasted turn, answered
    assert env.step("07").observation == (Message("user", "+"),)  # two digits with a leading zero is 7
    win = env.step("20")
    assert win.done and win.reward == 1.0 and win.observation == ()
    env.reset((0, 99, 99), 1)
    for _ in range(MAX_TURNS - 1):
        assert not env.step("0").done
    last = env.step("1")
    assert last.done and last.reward == 0.0 and last.info == {}
    for bad in ("", "100", "5-", "x", "٣"):  # empty, three digits, a stray token, not a digit, a non-ASCII digit
        env.reset((0, 99, 5), 2)
        step = env.step(bad)
        assert step.done and step.reward == 0.0 and step.info["error"] == "malformed_tool_call", bad
    with pytest.raises(ValueError, match="is not \\(lo, hi, number\\)"):
        env.reset((10, 60, 61), 0)


def test_bisection_always_wins_and_the_sloppy_player_that_always_slips_often_loses():
    rng = np.random.default_rng(0)
    items = [tuple(int(v) for v in row) for row in all_items()[::97]]
    assert all(int(play(it, rng, 0.0)[-1][0]) == it[2] and len(play(it, rng, 0.0)) <= MAX_TURNS for it in items)
    slipping = np.mean([int(play(it, rng, 1.0)[-1][0]) == it[2] for it in items])
    assert 0.3 < slipping < 0.5, slipping  # the tenth-cut: what the warm start's greedy imitation plays
    assert len(all_items()) == 88_400 and (all_items()[:, 1] - all_items()[:, 0] + 1).min() == MIN_WIDTH


def _episode(env, item, guesses_for):
    """Plays `guesses_for(prompt, answers so far)` until the episode ends; its reward."""
    text, answers = env.reset(item, 0)[0].content, []
    for _ in range(MAX_TURNS):
        step = env.step(guesses_for(text, answers))
        if step.done:
            return step.reward
        answers.append(step.observation[0].content)
    return 0.0


def _bisect(prompt, answers, lying=False):
    lo, hi = (int(v) for v in prompt.rstrip(":").split(","))
    guess = (lo + hi) // 2
    for answer in answers:  # replay what the answers left
        if (answer == "+") != lying:
            lo = guess + 1
        else:
            hi = guess - 1
        guess = (lo + hi) // 2
    return str(guess)


def test_the_reward_needs_the_environments_answers():
    """Bisection reading the answers wins every test item; the same player reading them reversed,
    and every player that ignores them, wins at most 7 of a range's 50-100 numbers."""
    task = GuessNumberTask(TaskConfig(name="guess_number", eval_size=512, validation_size=512))
    env = GuessNumber()
    reads = [_episode(env, it, _bisect) for it in task.eval_problems]
    lies = [_episode(env, it, lambda p, a: _bisect(p, a, lying=True)) for it in task.eval_problems]
    blind_bisect = [_episode(env, it, lambda p, a: _bisect(p, ["-"] * len(a))) for it in task.eval_problems]
    blind_scan = [_episode(env, it, lambda p, a: str(int(p.split(",")[0]) + len(a))) for it in task.eval_problems]
    assert np.mean(reads) == 1.0
    bound = MAX_TURNS / MIN_WIDTH
    for blind in (lies, blind_bisect, blind_scan):
        assert np.mean(blind) <= bound, np.mean(blind)


def test_the_splits_are_fixed_and_the_sloppy_players_is_its_own():
    config = TaskConfig(name="guess_number", eval_size=512, validation_size=512)
    task = GuessNumberTask(config)
    splits = [task.eval_problems, task.validation_problems, task.warmstart_problems, [tuple(r) for r in task._pool]]
    assert [len(s) for s in splits[:3]] == [512, 512, 2000]
    assert sum(map(len, splits)) == len(all_items()) == len(set().union(*map(set, splits)))  # a partition
    small = GuessNumberTask(TaskConfig(name="guess_number", eval_size=512, validation_size=512, train_size=1000))
    assert (small.eval_problems, small.validation_problems, small.warmstart_problems) == \
        (task.eval_problems, task.validation_problems, task.warmstart_problems)
    assert [tuple(r) for r in small._pool] == splits[3][:1000]  # a smaller pool is the start of the full one
    warm, held = set(task.warmstart_problems), set(task.eval_problems) | set(task.validation_problems)
    tokens, _, loss = task.supervised_batch(seed=7, index=0, n=64, max_new_tokens=27, carry_error=0.75)
    warm_prompts = {tuple(r) for r in task.encode_prompts(sorted(warm))[0].tolist()}
    assert {tuple(r) for r in tokens[:, :task.prompt_len].tolist()} <= warm_prompts
    assert not loss[:, :task.prompt_len].any() and loss.any()
    drawn = {p for i in range(20) for p in task.train_problems(seed=7, index=i, n=64)}
    assert not drawn & (warm | held)


def test_latency_draws_are_repeatable_from_the_seed_and_have_the_declared_median():
    lat = Latency("lognormal", median_s=0.05, sigma=0.5, seed=3)
    draws = [lat.draw(seed, turn, "") for seed in range(800) for turn in range(5)]
    assert draws == [Latency("lognormal", 0.05, 0.5, 3).draw(s, t, "") for s in range(800) for t in range(5)]
    assert draws != [Latency("lognormal", 0.05, 0.5, 4).draw(s, t, "") for s in range(800) for t in range(5)]
    assert abs(statistics.median(draws) / 0.05 - 1) < 0.05  # 4000 draws: the median's s.e. is about 1%
    log = np.log(draws)
    assert abs(log.std() - 0.5) < 0.03
    assert lat.draw(1, 2, "50;") != lat.draw(1, 2, "49;")  # other turns so far, another draw
    assert Latency("constant", median_s=0.2).draw(5, 1) == 0.2


def test_a_step_sleeps_its_draw_in_a_worker_thread_whatever_order_they_run_in():
    options = {"latency": {"distribution": "lognormal", "median_s": 0.02, "sigma": 0.5, "seed": 1}}
    lat = Latency.from_options(options["latency"])
    pool = EnvPool("guess_number", options, workers=8, timeout=10)
    ids = [pool.create() for _ in range(8)]
    pool.reset(ids, (0, 99, 77), 5)
    start = time.perf_counter()
    for i in ids:
        pool.step(i, "50")
    done = []
    while len(done) < len(ids):
        done += pool.results(wait=1.0)
    elapsed = time.perf_counter() - start
    pool.shutdown()
    expected = lat.draw(5, 0, "")  # the same episode seed, turn and history: the same wait in every worker
    assert elapsed >= expected and elapsed < 8 * expected  # slept in parallel, not one after another
    assert [s.observation for _, s in done] == [(Message("user", "+"),)] * 8
    with concurrent.futures.ThreadPoolExecutor(4) as ex:  # any order, any thread: the same draws
        assert list(ex.map(lambda t: lat.draw(9, t, ""), reversed(range(16))))[::-1] == \
            [lat.draw(9, t, "") for t in range(16)]


def test_bad_testbed_settings_are_refused_at_the_edge():
    validate(load_config(TESTBED))
    for overrides, message in [
        (["environment.workers=0"], "environment.options.latency: needs environment.workers > 0"),
        (["environment.options.latency.sigma=-1"], r"environment.options.latency.sigma: must be in \[0, 3\]"),
        (["environment.options.latency.distribution=pareto"], "latency.distribution: 'pareto' is not one of"),
        (["environment.options.latency.median_s=5"], "past environment.step_timeout_s=30: raise the timeout"),
        (["environment.name=guess_digit"], "task.name: guess_number is scored by its environment"),
        (["task.train_size=90000"], "task.train_size: 90000 problems beside the 3024 held out"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate(load_config(TESTBED, overrides))


def test_scripted_episodes_become_rows_with_only_the_players_turns_in_the_loss():
    tok = CharTokenizer()
    prompts, prompt_mask = np.array([[0, 7], [5, 6]], np.int32), np.array([[False, True], [True, True]])
    episodes = [[("50", "+"), ("75", "")], [("9", "-"), ("4", "+"), ("6", "")]]
    tokens, attention, loss = episode_rows(tok, prompts, prompt_mask, episodes, max_new_tokens=8)
    e = tok.encode
    first = e("50") + [tok.EOS] + e("+") + e("75") + [tok.EOS]  # 7 ids, then one pad
    assert tokens[0].tolist() == [0, 7] + first + [tok.PAD]
    assert attention[0].tolist() == [False, True] + [True] * 7 + [False]
    assert loss[0].tolist() == [False, False] + [True] * 3 + [False] + [True] * 3 + [False]
    second = e("9") + [tok.EOS] + e("-") + e("4") + [tok.EOS] + e("+") + e("6") + [tok.EOS]  # 8 ids: fills the row
    assert tokens[1].tolist() == [5, 6] + second and attention[1].all()
    assert loss[1].tolist() == [False, False, True, True, False, True, True, False, True, True]
    cut, _, cut_loss = episode_rows(tok, prompts, prompt_mask, episodes, max_new_tokens=4)  # cut at the row's end
    assert cut[1].tolist() == [5, 6] + second[:4] and cut_loss[1].tolist() == [False, False, True, True, False, True]




class EveryIdEndsATurn(CharTokenizer):
    @property
    def eos_ids(self):
        return tuple(range(self.vocab_size))


def small_evaluation_setup(env: str, eval_size: int = 24):
    from jaxreplay.models.transformer import init_params

    config = load_config(TESTBED, [
        "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
        "model.d_ff=64", "model.max_seq_len=10", "sampling.max_new_tokens=4", f"task.eval_size={eval_size}",
        "task.validation_size=40"])
    config = dataclasses.replace(config, environment=dataclasses.replace(
        config.environment, name=env, options={}, workers=2, eval_slots=16))
    graphdef, params = init_params(config.model, 0)
    task = GuessNumberTask(config.task)
    task.tokenizer = EveryIdEndsATurn()  # a random policy's first token ends its turn
    return config, task, graphdef, params


def test_evaluation_plays_greedy_episodes_on_the_test_and_the_validation_split():
    """Each split's success is its own items' (a hand count: the even numbers), under the keys
    stage 1 chooses on; a task without a validation split writes no validation key. The engine
    plays `environment.eval_slots` episodes at once, on as many thread workers."""
    from jaxreplay.train.eval import TEST_KEY, TURNS_KEY, VALIDATION_KEY, EpisodeEvaluator

    config, task, graphdef, params = small_evaluation_setup("mt_envs:EvenNumberWins")
    evaluator = EpisodeEvaluator(config, task, graphdef, params, live_vocab=task.tokenizer.vocab_size)
    assert evaluator.engine.slots == 16 and evaluator.runner.pool.workers == 16  # eval_slots episodes at once
    even = lambda split: float(np.mean([n % 2 == 0 for _, _, n in split]))
    scores = evaluator.evaluations(params)
    assert scores == {TEST_KEY: even(task.eval_problems), TURNS_KEY: 1.0,
                      VALIDATION_KEY: even(task.validation_problems)}
    assert scores[TEST_KEY] != scores[VALIDATION_KEY]  # the splits' own counts, not one split's twice
    task.validation_problems = []
    assert VALIDATION_KEY not in evaluator.evaluations(params)


def test_episode_pass_at_k_samples_each_items_episodes_as_one_group_of_its_own():
    """n episodes an item at temperature 1, scored per item: where the reward is the item's alone
    (even numbers win) every item wins all or none of its n, so pass@k is the hand count for every
    k; where it is the sampled turn's, items win some of their n, pass@1 is the share won and
    pass@k grows with k; the same seed plays the same episodes."""
    from jaxreplay.train.eval import PASSK_KEY, EpisodeEvaluator, episode_pass_at_k

    config, task, graphdef, params = small_evaluation_setup("mt_envs:EvenNumberWins")
    result = episode_pass_at_k(config, task, graphdef, params, (1, 4), seed=3)
    even = [n % 2 == 0 for _, _, n in task.eval_problems]
    assert result["correct_per_problem"] == [4 * e for e in even]
    assert result[PASSK_KEY] == {"1": float(np.mean(even)), "4": float(np.mean(even))}

    config, task, graphdef, params = small_evaluation_setup("mt_envs:EvenCharWins")
    result = episode_pass_at_k(config, task, graphdef, params, (1, 2, 4), seed=3)
    wins = np.array(result["correct_per_problem"])
    assert ((wins > 0) & (wins < 4)).any()  # sampled, not greedy: an item's episodes differ
    passk = result[PASSK_KEY]
    assert passk["1"] == pytest.approx(wins.mean() / 4) and passk["1"] < passk["2"] < passk["4"] <= 1
    assert episode_pass_at_k(config, task, graphdef, params, (1, 2, 4), seed=3) == result
    with pytest.raises(ValueError, match="give a temperature"):
        EpisodeEvaluator(config, task, graphdef, params, live_vocab=task.tokenizer.vocab_size, samples=4)


@pytest.mark.slow
def test_the_testbed_config_trains_a_few_steps_and_reports_turns_and_mu(tmp_path):
    from jaxreplay.train.driver import train
    from jaxreplay.train.metrics import read_metrics

    config = load_config(TESTBED, [
        "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
        "model.d_ff=64", "train.prompts_per_step=4", "train.group_size=4", "train.batch_size=16", "train.steps=3",
        "train.eval_every=3", "task.eval_size=16", "task.validation_size=16", "warmstart.steps=5",
        "replay.min_size_to_sample=16", "environment.workers=16", "environment.eval_slots=16",
        "environment.options.latency.median_s=0.002",
        "checkpoint.every=3", "run.progress_bar=false", f"run.dir={tmp_path / 'run'}",
        f"warmstart.cache_dir={tmp_path / 'ws'}"])
    train(config, log=lambda _: None)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    last = records[-1]
    assert last["episode/turns"] >= 1 and np.isfinite(last["cost/mu"]) and last["cost/mu"] > 0
    assert 0 <= last["eval/accuracy"] <= 1 and 0 <= last["eval/validation_accuracy"] <= 1  # what stage 1 reads
    assert last["env/errors/timeout"] == 0 and last["env/errors/exception"] == 0
