"""Multi-turn episodes through the rollout engine: a row's turns and its environment's answers
interleave in one sequence; only the model's tokens are trained, each with the log-prob the
learner re-scores; an environment that raises or times out ends its episode, counted; a config
asking for turns on the static sampler is refused."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.config import ConfigError, load_config, validate
from jaxreplay.learn.scoring import sequence_scores
from jaxreplay.models import sharding
from jaxreplay.models.transformer import init_params, score_hidden
from jaxreplay.rollout.actor import make_streaming_actor
from jaxreplay.tasks.registry import make_task
from jaxreplay.train.metric_keys import KEYS as DOCUMENTED_KEYS
from jaxreplay.train.metrics import read_metrics

from test_train import ROOT

DEMO_MT = ROOT / "configs" / "demo_multiturn.yaml"
TINY_MT = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
           "model.d_ff=64", "train.prompts_per_step=4", "train.group_size=4", "sampling.engine_chunk_steps=2"]


def test_turns_on_the_static_sampler_are_refused_at_the_edge():
    with pytest.raises(ConfigError, match="environment.name: multi-turn episodes .* need sampling.engine: continuous"):
        validate(load_config(DEMO_MT, ["sampling.engine=static"]))
    with pytest.raises(ConfigError, match="environment.name: unknown environment 'nope': known names are "
                                          "agent_loop, calculator, guess_digit, guess_number, skyrl, or give package.module:factory"):
        validate(load_config(DEMO_MT, ["environment.name=nope"]))
    with pytest.raises(ConfigError, match="task.name: guess_digit is scored by its environment"):
        validate(load_config(DEMO_MT, ["environment.name="]))
    validate(load_config(DEMO_MT))


def test_environment_options_it_cannot_build_from_are_refused_at_the_edge():
    with pytest.raises(ConfigError, match=r"environment.options: guess_digit does not build from \{'no_such_option': 1\}"):
        validate(load_config(DEMO_MT, ["environment.options={no_such_option: 1}"]))
    with pytest.raises(ConfigError, match="environment.options: calculator does not build from"):
        validate(load_config(DEMO_MT, ["environment.name=calculator", "environment.options={on_malformed: explode}"]))


def run_episodes(overrides=(), advances=40, params_seed=0, prefill_answers=True, engine_stats=None, mesh=None,
                 sharpen=1.0, stop_ids=None, until=None, deadline_s=120.0):
    """Rows of the groups that complete in `advances` chunks under fixed random weights, and
    after them, while `until(stats)` is false, in more chunks for up to `deadline_s` seconds
    (what waits on wall-clock timeouts needs); `engine_stats`, a list, gets the engine's
    counters. With a `mesh`, the engine's pool and the weights lie on it. `sharpen` scales the
    final norm (the logits): draws no sharded reduction's last bits can flip. `stop_ids` end a
    turn (default: the tokenizer's EOS)."""
    config = load_config(DEMO_MT, [*TINY_MT, *overrides])
    task = make_task(config.task)
    graphdef, params = init_params(config.model, params_seed)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * sharpen if "final_norm" in jax.tree_util.keystr(path) else x, params)
    if mesh is not None:
        params = sharding.shard_params(params, mesh)
    tok = task.tokenizer
    actor = make_streaming_actor(graphdef, config, task, params, stop_ids=stop_ids or tok.eos_ids, pad_id=tok.pad_id,
                                 live_vocab=tok.vocab_size, mesh=mesh)
    actor.engine.prefill_answers = prefill_answers
    rows, stats = [], []
    deadline = time.monotonic() + deadline_s
    done = 0
    while done < advances or (until is not None and not until(stats) and time.monotonic() < deadline):
        got, s = actor.advance(params, 0)
        done += 1
        if got is not None:
            rows.append(got)
            stats.append(s)
    actor.episodes.pool.shutdown()
    if engine_stats is not None:
        engine_stats.append(actor.engine.stats)
    assert rows, "no group completed"
    return config, task, graphdef, params, {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}, stats


@functools.lru_cache(maxsize=None)
def zero_latency_run():
    return run_episodes()


def test_episodes_interleave_model_and_environment_tokens_and_train_only_the_models():
    config, task, _, _, rows, stats = zero_latency_run()
    tok, p = task.tokenizer, task.prompt_len
    eos, answers = tok.EOS, set(tok.encode("+-"))
    multi = 0
    for tokens, attention, completion in zip(rows["tokens"], rows["attention_mask"], rows["completion_mask"]):
        body, trained = tokens[p:][attention[p:]], completion[p:][attention[p:]]
        assert attention[p:].sum() == len(body) and not attention[p:][len(body):].any(), "one contiguous sequence"
        # every token after a model turn's EOS is the environment's answer, then the model again
        for i in range(len(body)):
            after_eos = i > 0 and body[i - 1] == eos and trained[i - 1]
            assert trained[i] != after_eos, (tok.decode(body), i)
            if after_eos:
                assert body[i] in answers
        multi += (~trained).sum() > 0
        assert completion[:p].sum() == 0
    assert multi >= 4, "the fixture should give several multi-turn episodes"
    turns = np.mean([s["episode/turns"] for s in stats])  # turns that ended on EOS (random weights often run on)
    assert 0 < turns <= config.environment.max_turns


def test_behaviour_log_probs_of_episodes_equal_the_learners_rescoring():
    config, task, graphdef, params, rows, _ = zero_latency_run()
    h, unembed = score_hidden(graphdef, params, jnp.asarray(rows["tokens"]), jnp.asarray(rows["attention_mask"]))
    learner, _ = sequence_scores(h, jnp.asarray(rows["tokens"]), unembed, temperature=config.sampling.temperature,
                                 with_entropy=False, live_vocab=task.tokenizer.vocab_size)
    mask = rows["completion_mask"]
    np.testing.assert_allclose(np.where(mask, rows["logprobs"], 0.0), np.where(mask, np.asarray(learner), 0.0),
                               atol=1e-5)


def test_rewards_are_the_environments_and_advantages_compare_one_groups_episodes():
    config, task, _, _, rows, _ = zero_latency_run()
    g = config.train.group_size
    tok, p = task.tokenizer, task.prompt_len
    for i, (tokens, completion, reward) in enumerate(zip(rows["tokens"], rows["completion_mask"], rows["reward"])):
        turns = tok.decode([t for t, c in zip(tokens[p:], completion[p:]) if c and t != tok.EOS])
        # a winning episode's last model turn is the only guess the environment did not answer
        assert reward in (0.0, 1.0)
    adv = rows["advantage"].reshape(-1, g)
    np.testing.assert_allclose(adv.mean(axis=1), 0.0, atol=1e-5)


# Environments whose answers are several ids: prefilled onto the row, not fed one per decode step.
# A 10-id answer is prefilled as 16 inputs (9 real): a row's last ones run past the cache's end.
LONG_ANSWERS = ["environment.name=mt_envs:Echo", "environment.options={turns: 3, reply: '+-+-+-+-+-'}"]
SHORT_ANSWERS = ["environment.name=mt_envs:Echo", "environment.options={turns: 3, reply: '+-+-'}"]


def test_multi_token_answers_are_prefilled_and_make_the_rows_feeding_them_makes():
    """The same episodes with the answers prefilled in one call as fed one per decode step:
    equal tokens, masks, versions and rewards, log-probs within float error; the prefill program
    ran 9 of each answer's 10 inputs (the last is fed by the decode step before the draw)."""
    fed_stats, prefilled_stats = [], []
    *_, fed, _ = run_episodes(LONG_ANSWERS, prefill_answers=False, engine_stats=fed_stats)
    *_, prefilled, _ = run_episodes(LONG_ANSWERS, engine_stats=prefilled_stats)
    (fed_stats,), (prefilled_stats,) = fed_stats, prefilled_stats
    assert prefilled_stats.answer_prefills > 0 == fed_stats.answer_prefills
    assert 10 * prefilled_stats.prefilled_tokens == 9 * prefilled_stats.appended_tokens > 0, "9 of 10 inputs"
    fed, prefilled = by_id(fed), by_id(prefilled)
    common = sorted(set(fed) & set(prefilled))
    assert len(common) >= 16 and sum((~fed[i]["completion_mask"] & fed[i]["attention_mask"]).sum() > 10
                                     for i in common) >= 4, "several episodes with answers"
    for i in common:
        for k in ("tokens", "attention_mask", "completion_mask", "policy_version", "last_version", "reward"):
            np.testing.assert_array_equal(fed[i][k], prefilled[i][k], err_msg=f"{k} of rollout {i}")
        np.testing.assert_allclose(fed[i]["logprobs"], prefilled[i]["logprobs"], atol=1e-5)


def test_behaviour_log_probs_after_chunk_prefilled_answers_equal_the_learners_rescoring():
    # 4-id answers: 3 inputs, a call of 4 made 6 to run in chunks of 3
    config, task, graphdef, params, rows, _ = run_episodes([*SHORT_ANSWERS, "sampling.prefill_chunk_size=3"])
    h, unembed = score_hidden(graphdef, params, jnp.asarray(rows["tokens"]), jnp.asarray(rows["attention_mask"]))
    learner, _ = sequence_scores(h, jnp.asarray(rows["tokens"]), unembed, temperature=config.sampling.temperature,
                                 with_entropy=False, live_vocab=task.tokenizer.vocab_size)
    mask = rows["completion_mask"]
    assert (rows["attention_mask"] & ~mask).sum() > (rows["attention_mask"][:, :task.prompt_len]).sum() + 4
    np.testing.assert_allclose(np.where(mask, rows["logprobs"], 0.0), np.where(mask, np.asarray(learner), 0.0),
                               atol=1e-5)


def assert_same_row_field(a, b, key, rollout):
    """Tokens, masks, rewards and advantages exactly; log-probs to a float32 ulp or two: on jax 0.11.2
    (the gpu-image lane) XLA:CPU's log-prob of a token moves by 1 ulp (2.4e-7) with which rows share
    its decode chunk, which a schedule decides."""
    if key == "logprobs":
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=f"{key} of rollout {rollout}")
    else:
        np.testing.assert_array_equal(a, b, err_msg=f"{key} of rollout {rollout}")


def by_id(rows):
    return {int(i): {k: v[n] for k, v in rows.items()} for n, i in enumerate(rows["rollout_id"])}


def test_environment_latency_changes_the_schedule_never_a_row():
    """Steps that take a random few ms in worker threads: rows wait in their slots while others
    decode, and under fixed weights every episode equals the zero-latency run's (each token's key
    is its row's and its place's, whatever chunk it is drawn in)."""
    *_, fast, _ = zero_latency_run()
    *_, slow, _ = run_episodes(["environment.name=mt_envs:SlowGuess", "environment.workers=3",
                                "environment.options={sleep: 0.02}"], advances=300)
    fast, slow = by_id(fast), by_id(slow)
    common = sorted(set(fast) & set(slow))
    assert len(common) >= 16
    for i in common:
        for k in ("tokens", "attention_mask", "completion_mask", "logprobs", "reward", "advantage"):
            assert_same_row_field(fast[i][k], slow[i][k], k, i)


def test_an_environment_that_raises_ends_its_episode_counted_and_the_run_goes_on():
    *_, rows, stats = run_episodes(["environment.name=mt_envs:SlowGuess", "environment.workers=2",
                                    "environment.options={sleep: 0.0, raise_at: 2}"], advances=60)
    assert sum(s["env/errors/exception"] for s in stats) > 0
    assert len(rows["reward"]) >= 16 and np.isfinite(rows["advantage"]).all()


def environment_tokens(rows, prompt_len):
    """Per row, the attended completion tokens outside the completion mask: the environment's answers."""
    return (rows["attention_mask"][:, prompt_len:] & ~rows["completion_mask"][:, prompt_len:]).sum(axis=1)


def test_an_answer_the_tokenizer_cannot_encode_ends_its_episode_counted_and_the_run_goes_on():
    """The demo's character tokenizer has no `h`: an episode whose environment answers "hello world"
    ends at that step (counted under its own key), before any of it reaches the row."""
    config, task, *_, rows, stats = run_episodes(["environment.name=mt_envs:Echo",
                                                  "environment.options={reply: 'hello world'}"])
    assert sum(s["env/errors/unencodable_observation"] for s in stats) > 0
    assert not environment_tokens(rows, task.prompt_len).any()
    assert len(rows["reward"]) >= 16 and np.isfinite(rows["advantage"]).all()


@pytest.mark.parametrize("prompt", ["hello", ":::"], ids=["unencodable", "wider_than_the_prompt"])
def test_a_first_observation_that_cannot_be_the_prompt_ends_every_episode_of_its_group_counted(prompt):
    """One the tokenizer cannot encode, or one wider than the task's prompt (2 ids)."""
    config, task, *_, rows, stats = run_episodes(["environment.name=mt_envs:Echo",
                                                  f"environment.options={{prompt: '{prompt}'}}"], advances=12)
    assert sum(s["env/errors/unencodable_observation"] for s in stats) == len(rows["reward"]) >= 16
    assert sum(s["env/errors/exception"] for s in stats) == 0
    assert not rows["attention_mask"][:, :task.prompt_len].any() and not environment_tokens(rows, task.prompt_len).any()
    assert (rows["reward"] == 0).all()


def counted(result):
    return {kind: n for kind, n in result["errors"].items() if n}


# Gemma-like: a template that refuses the system and tool roles (it raises while rendering them).
NO_SYSTEM_NO_TOOLS = ("{% for m in messages %}{% if m.role in ('system', 'tool') %}"
                      "{{ raise_exception(m.role + ' role not supported') }}{% endif %}"
                      "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_chat_template_that_raises_on_an_observation_ends_that_episode_counted(tmp_path):
    """The calculator's system message (at reset) and its tool results (after a call) through a
    template that refuses both: the episodes end, counted, and the others go on."""
    from jaxreplay.models.tokenizer import load_tokenizer
    from jaxreplay.rollout.episodes import EpisodeRunner
    from jaxreplay.tasks.chat import chat_format_for
    from jaxreplay.tasks.environment import EnvPool
    from jaxreplay.tasks.tools import calculator_environment
    from tiny_hf import write_char_tokenizer

    write_char_tokenizer(tmp_path, NO_SYSTEM_NO_TOOLS)
    tok = load_tokenizer(tmp_path)
    item = {"question": "12*34=?", "answer": "408"}
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'

    def runner(**options):
        return EpisodeRunner(EnvPool("calculator", options), chat_format_for(tok, environment=calculator_environment),
                             tok, group_size=2, prompt_len=64, max_turns=4)

    # at reset: the group's shared prompt cannot be rendered; both episodes end at their first turn
    episodes = runner(system="Be brief.")
    tokens, mask = episodes.open("g", item, seed=0)
    assert not mask.any()
    for row in range(2):
        episodes.ended("g", row, np.asarray(tok.encode("408") + [tok.eos_id]), cut=False)
    assert [answer for *_, answer in episodes.answers(0.0)] == [None, None]
    result = episodes.result("g")
    assert counted(result) == {"unencodable_observation": 2} and result["turns"].tolist() == [1, 1]

    # at a step: row 0 calls the tool (its result cannot be rendered), row 1 answers right away
    episodes = runner()
    tokens, mask = episodes.open("g", item, seed=0)
    assert tokens[mask].tolist() == tok.encode("<|im_start|>user\n12*34=?<|im_end|>\n<|im_start|>assistant\n")
    episodes.ended("g", 0, np.asarray(tok.encode(call) + [tok.eos_id]), cut=False)
    episodes.ended("g", 1, np.asarray(tok.encode("408") + [tok.eos_id]), cut=False)
    assert sorted((row, answer) for _, row, answer in episodes.answers(0.0)) == [(0, None), (1, None)]
    result = episodes.result("g")
    assert counted(result) == {"unencodable_observation": 1} and result["reward"].tolist() == [0.0, 1.0]


def timed_out(stats):
    """A step past its timeout was counted: the group it ended completes a second or so after
    the hang, when a fast machine may have run all its planned chunks (a CI flake)."""
    return sum(s["env/errors/timeout"] for s in stats) > 0


def test_an_environment_that_hangs_in_a_worker_process_is_killed_counted_and_the_run_goes_on():
    *_, rows, stats = run_episodes(["environment.name=mt_envs:SlowGuess", "environment.workers=2",
                                    "environment.processes=true", "environment.step_timeout_s=1",
                                    "environment.options={sleep: 0.0, hang_at: 1, hang_item: 3}"], advances=60,
                                   until=timed_out)
    assert timed_out(stats)
    assert len(rows["reward"]) >= 16 and np.isfinite(rows["advantage"]).all()


def test_a_resumed_actor_restarts_episodes_in_flight_from_reset_and_makes_the_same_rows():
    """Position after 10 chunks; a fresh actor resumed there regenerates the groups in flight from
    reset(item, seed) and continues the prompt stream: with a deterministic zero-latency
    environment, every rollout both make is bit-equal."""
    config = load_config(DEMO_MT, TINY_MT)
    task = make_task(config.task)
    graphdef, params = init_params(config.model, 0)
    tok = task.tokenizer
    make = lambda: make_streaming_actor(graphdef, config, task, params, stop_ids=tok.eos_ids, pad_id=tok.pad_id,
                                        live_vocab=tok.vocab_size)
    first, rows_a, rows_b = make(), [], []
    for n in range(40):
        got, stats = first.advance(params, 0)
        if n == 9:
            position = stats["position"]
            assert position.in_flight, "the fixture should checkpoint with episodes in flight"
        if got is not None:
            rows_a.append(got)
    second = make()
    second.resume(position)
    for _ in range(30):
        got, _ = second.advance(params, 0)
        if got is not None:
            rows_b.append(got)
    a = by_id({k: np.concatenate([r[k] for r in rows_a]) for k in rows_a[0]})
    b = by_id({k: np.concatenate([r[k] for r in rows_b]) for k in rows_b[0]})
    g = config.train.group_size
    regenerated = {k * g for k in position.in_flight}
    assert regenerated & set(b), "an in-flight group completed after the resume"
    common = sorted(set(a) & set(b))
    assert len(common) >= 16
    for i in common:
        for k in a[i]:
            assert_same_row_field(a[i][k], b[i][k], k, i)


def test_a_restart_drops_episodes_whose_steps_still_run_and_makes_the_same_rows():
    """What a run does at each checkpoint: the actor drops its groups in flight, episodes whose
    steps still run in worker threads included (their answers, when they come, are ignored), and
    regenerates them from reset(item, seed): under fixed weights every rollout equals the
    zero-latency run's, and none is made twice."""
    *_, fast, _ = zero_latency_run()
    config = load_config(DEMO_MT, [*TINY_MT, "environment.name=mt_envs:SlowGuess", "environment.workers=3",
                                   "environment.options={sleep: 0.05}"])
    task = make_task(config.task)
    graphdef, params = init_params(config.model, 0)
    tok = task.tokenizer
    actor = make_streaming_actor(graphdef, config, task, params, stop_ids=tok.eos_ids, pad_id=tok.pad_id,
                                 live_vocab=tok.vocab_size)
    rows, restarts = [], 0
    try:
        for _ in range(400):
            got, _ = actor.advance(params, 0)
            if got is not None:
                rows.append(got)
            if actor.engine._parked and restarts < 2 and len(rows) > 2 * restarts:  # rows wait for their steps
                actor.restart()
                restarts += 1
    finally:
        actor.episodes.pool.shutdown()
    assert restarts == 2
    ids = np.concatenate([r["rollout_id"] for r in rows])
    assert len(ids) == len(set(ids.tolist())), "a rollout made twice"
    slow = by_id({k: np.concatenate([r[k] for r in rows]) for k in rows[0]})
    fast = by_id(fast)
    common = sorted(set(fast) & set(slow))
    assert len(common) >= 16
    for i in common:
        for k in ("tokens", "attention_mask", "completion_mask", "logprobs", "reward", "advantage"):
            assert_same_row_field(fast[i][k], slow[i][k], k, i)


RUN_MT = [*TINY_MT, "task.eval_size=16", "warmstart.steps=10", "train.batch_size=16", "train.eval_every=2",
          "replay.max_size=64", "replay.min_size_to_sample=16", "checkpoint.every=2", "run.progress_bar=false"]


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_a_multi_turn_run_trains_evaluates_episodes_and_holds_the_limiter(tmp_path, placement):
    """The driver's one path: episodes in, the limiter's ratio, greedy episode evaluation, the
    documented records; disaggregated runs its actor on its own thread and mesh."""
    import subprocess
    import sys

    from conftest import cpu_devices_env

    extra = ["mesh.actor_devices=1", "mesh.data=-1"] if placement == "disaggregated" else []
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "jaxreplay", "train", str(DEMO_MT), *RUN_MT, *extra,
                           "train.steps=4", f"run.dir={run_dir}", f"warmstart.cache_dir={tmp_path / 'ws'}"],
                          env=cpu_devices_env(2), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = read_metrics(run_dir)
    # the done line's turns are the last evaluation's, over the test split (the latest actor batch is a few episodes)
    last_eval = next(r for r in reversed(records) if "eval/turns" in r)
    assert f"turns/episode {last_eval['eval/turns']:.2f} |" in proc.stdout
    assert [r["step"] for r in records] == list(range(5))
    for r in records:
        assert r.keys() <= DOCUMENTED_KEYS, r.keys() - DOCUMENTED_KEYS
    assert "eval/turns" in records[0] and 0 <= records[-1]["eval/accuracy"] <= 1
    assert records[-1]["episode/turns"] > 0 and "cost/mu" in records[-1]
    if placement == "colocated":  # `jaxreplay eval`: greedy episodes of the saved policy, as the loop plays, and pass@k
        proc = subprocess.run([sys.executable, "-m", "jaxreplay", "eval", str(DEMO_MT), *RUN_MT,
                               "--checkpoint", str(run_dir), "--k", "1,4", "--out", str(tmp_path / "eval.json")],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["episodes"] == 16 and 0 <= result["success_greedy"] <= 1 and result["turns_greedy"] > 0
        assert 0 <= result["pass@k_t1.0"]["1"] <= result["pass@k_t1.0"]["4"] <= 1
        successes = json.loads((tmp_path / "eval.json").read_text())["correct_per_problem"]
        assert len(successes) == 16 and max(successes) <= 4  # each test item's 4 episodes


def train_mt(tmp_path, name, *overrides, log=lambda _: None):
    from jaxreplay.train.driver import train

    config = load_config(DEMO_MT, [*RUN_MT, f"run.dir={tmp_path / name}", f"warmstart.cache_dir={tmp_path / 'ws'}",
                                   *overrides])
    return config, train(config, log=log)


@pytest.mark.slow
def test_a_multi_turn_run_resumed_with_episodes_in_flight_equals_the_run_never_stopped(tmp_path):
    """2 steps, then the same command with train.steps=6, equals 6 steps straight: with a
    deterministic zero-latency environment (workers 0), the episodes in flight at the checkpoint
    restart from reset(item, seed) under the checkpoint's weights and nothing is trained or
    counted twice: every step recorded once with the same metrics, the same limiter counters
    and prompt position, and bit-equal params, optimizer state and waiting rows. The environment
    fails on 3 of the 10 digits: every episode that failed is counted once in the run's totals."""
    from jaxreplay.learn.learner import make_optimizer
    from jaxreplay.rollout.rollouts import row_spec
    from jaxreplay.train.checkpoint import Checkpointer
    from jaxreplay.train.run import checkpoint_tree
    from test_train import jax_leaves

    # AsymRE: its advantage r - (V + dV) is never zero, so every step moves the params.
    same = ["environment.workers=0", "replay.selector=fifo", "train.eval_every=3", "train.loss=asymre",
            "train.advantage=group_centered", "environment.name=mt_envs:FailingGuess",
            "environment.options={raise_on: [0, 1], unencodable: [2]}"]
    straight, summary = train_mt(tmp_path, "straight", *same, "train.steps=6")
    train_mt(tmp_path, "resumed", *same, "train.steps=2")
    lines = []
    resumed, resumed_summary = train_mt(tmp_path, "resumed", *same, "train.steps=6", log=lines.append)
    a, b = read_metrics(straight.run.dir), read_metrics(resumed.run.dir)
    assert [r["step"] for r in b] == list(range(7))
    assert b[2]["engine/groups_in_flight"] > 0, "the checkpoint should hold episodes in flight"
    assert sum(r["grad_norm"] > 0 for r in a[1:]) >= 3, "the runs must actually learn for this to test anything"
    for ra, rb in zip(a, b, strict=True):
        for key in ra.keys() & rb.keys():
            if not key.startswith(("time/", "cost/")):
                assert ra[key] == rb[key], (ra["step"], key)

    task = make_task(straight.task)
    graphdef, params = init_params(straight.model, 0)
    like = checkpoint_tree(params, make_optimizer(straight.train).init(params), None,
                           row_spec(straight, task.prompt_len), straight.rollouts_per_step)
    (state_a, progress_a), (state_b, progress_b) = [
        Checkpointer(tmp_path / name / "checkpoints", keep=2).restore(like) for name in ("straight", "resumed")]
    untimed = lambda p: {k: v for k, v in dataclasses.asdict(p).items() if not k.startswith("time_") and k not in ("accounting", "replay_checkpoint")}
    assert untimed(progress_a) == untimed(progress_b)  # steps, versions, prompt position, limiter counters
    assert progress_a.learner_step == 6 and progress_a.replay_counters
    for x, y in zip(jax_leaves(state_a), jax_leaves(state_b), strict=True):
        np.testing.assert_array_equal(x, y)

    # The errors of every group generated (submitted, not in flight at the end), each once.
    g, n = straight.train.group_size, straight.train.prompts_per_step
    digits = [task.train_problems(straight.run.seed, k // n, n)[k % n]
              for k in sorted(set(range(progress_a.engine_started)) - set(progress_a.engine_in_flight))]
    assert len(digits) * g == summary["rollouts/generated"]
    expected = {"exception": g * sum(d in (0, 1) for d in digits), "unencodable_observation": g * digits.count(2),
                "timeout": 0}
    assert expected["exception"] and expected["unencodable_observation"], digits
    for run, run_summary in ((straight, summary), (resumed, resumed_summary)):
        on_disk = json.loads(Path(run.run.dir, "summary.json").read_text())
        for kind, count in expected.items():
            key = f"env/errors_total/{kind}"
            assert run_summary[key] == on_disk[key] == read_metrics(run.run.dir)[-1][key] == count, (key, run.run.dir)
    assert progress_a.accounting["episode_errors"] == progress_b.accounting["episode_errors"]
    assert (f"env errors exception {expected['exception']}, " in lines[-1]
            and f"unencodable_observation {expected['unencodable_observation']} |" in lines[-1]), lines[-1]


@pytest.mark.slow
def test_two_processes_each_run_their_own_environments_and_both_fill_the_table(tmp_path):
    """Multi-host (two processes over gloo standing in for a pod's hosts): each process opens its
    own environment instances for its own slice of the prompt stream, and its episodes enter its
    own shard of the table; the limiter counts both, and the done line says turns per episode."""
    import subprocess
    import sys

    from conftest import cpu_devices_env
    from test_resume import _finish, _free_port

    run_dir = tmp_path / "run"
    common = [*RUN_MT, "warmstart.steps=0", "train.eval_every=1000", "mesh.data=-1", "replay.backend=inprocess",
              "train.steps=3", "distributed.enabled=true", "distributed.num_processes=2",
              f"distributed.coordinator_address=127.0.0.1:{_free_port()}", f"run.dir={run_dir}"]
    procs = [subprocess.Popen([sys.executable, "-m", "jaxreplay.cli", "train", str(DEMO_MT), *common,
                               f"distributed.process_id={i}"], cwd=ROOT, env=cpu_devices_env(2),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    results = _finish(procs, 300)
    assert [rc for rc, _ in results] == [0, 0], [out[-2000:] for _, out in results]
    assert "turns/episode" in results[0][1]
    processes = [json.loads((run_dir / f"process-{i}.json").read_text()) for i in range(2)]
    inserted = [p["rows_inserted"] for p in processes]
    assert all(n > 0 for n in inserted), inserted
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["replay/inserts"] == sum(inserted)
    # The episode statistics are of both processes' episodes, the same on each.
    assert processes[0]["episode/turns"] == processes[1]["episode/turns"] == summary["episode/turns"] > 0
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(4))
    assert all(r.keys() <= DOCUMENTED_KEYS and "episode/turns" in r for r in records[1:])
    assert all(isinstance(r["env/errors/malformed_tool_call"], int) for r in records[1:])
