"""Multi-turn episodes through the rollout engine: a row's turns and its environment's answers
interleave in one sequence; only the model's tokens are trained, each with the log-prob the
learner re-scores; an environment that raises or times out ends its episode, counted; a config
asking for turns on the static sampler is refused."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.config import ConfigError, load_config, validate
from jaxreplay.learn.scoring import sequence_scores
from jaxreplay.models.transformer import init_params, score_hidden
from jaxreplay.rollout.actor import make_streaming_actor
from jaxreplay.tasks.registry import make_task

from test_train import ROOT

DEMO_MT = ROOT / "configs" / "demo_multiturn.yaml"
TINY_MT = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
           "model.d_ff=64", "train.prompts_per_step=4", "train.group_size=4", "sampling.engine_chunk_steps=2"]


def test_turns_on_the_static_sampler_are_refused_at_the_edge():
    with pytest.raises(ConfigError, match="environment.name: multi-turn episodes .* need sampling.engine: continuous"):
        validate(load_config(DEMO_MT, ["sampling.engine=static"]))
    with pytest.raises(ConfigError, match="environment.name: unknown environment 'nope'"):
        validate(load_config(DEMO_MT, ["environment.name=nope"]))
    with pytest.raises(ConfigError, match="task.name: guess_digit is scored by its environment"):
        validate(load_config(DEMO_MT, ["environment.name="]))
    validate(load_config(DEMO_MT))


def run_episodes(overrides=(), advances=40, params_seed=0):
    """Rows of the groups that complete in `advances` chunks under fixed random weights."""
    config = load_config(DEMO_MT, [*TINY_MT, *overrides])
    task = make_task(config.task)
    graphdef, params = init_params(config.model, params_seed)
    tok = task.tokenizer
    actor = make_streaming_actor(graphdef, config, task, params, stop_ids=tok.eos_ids, pad_id=tok.pad_id,
                                 live_vocab=tok.vocab_size)
    rows, stats = [], []
    for _ in range(advances):
        got, s = actor.advance(params, 0)
        if got is not None:
            rows.append(got)
            stats.append(s)
    actor.episodes.pool.shutdown()
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
