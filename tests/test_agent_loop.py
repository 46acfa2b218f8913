"""Episodes from an outside agent loop (`environment.name: agent_loop`): a plain Python client loop
(tests/agent_loops.py, through the official OpenAI client) calls the endpoint the trainer serves, 2-3
calls an episode, adding its own tokens between them. The rows hold the engine's draws in the loss
with their log-probs, the client's tokens attended and never trained; a re-rendered prompt is refused
and counted; a run stopped and resumed counts what a straight one does."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxreplay.config import ConfigError, load_config, validate
from jaxreplay.train.metrics import read_metrics

from test_multiturn import DEMO_MT, RUN_MT, TINY_MT

HARNESS = ["environment.name=agent_loop", "environment.step_timeout_s=60"]


def loop_options(lockstep: bool = False, **harness_options) -> str:
    return (f"environment.options={{harness: 'agent_loops:guess_digit', lockstep: {str(lockstep).lower()}, "
            f"harness_options: {harness_options}}}")


def test_an_agent_loop_is_checked_at_the_edge():
    with pytest.raises(ConfigError, match="environment.options.harness: give the agent loop as package.module"):
        validate(load_config(DEMO_MT, HARNESS))
    with pytest.raises(ConfigError, match="harness 'agent_loops:nope': cannot import it"):
        validate(load_config(DEMO_MT, [*HARNESS, "environment.options={harness: 'agent_loops:nope'}"]))
    with pytest.raises(ConfigError, match="call_format: 'xml' is not one of"):
        validate(load_config(DEMO_MT, [*HARNESS, "environment.options={harness: 'agent_loops:guess_digit', "
                                                 "call_format: xml}"]))
    with pytest.raises(ConfigError, match="need sampling.engine: continuous"):
        validate(load_config(DEMO_MT, [*HARNESS, loop_options(), "sampling.engine=static"]))
    validate(load_config(DEMO_MT, [*HARNESS, loop_options()]))


@pytest.mark.needs_serve
def test_the_rows_train_the_engines_draws_and_never_the_clients_tokens():
    """Groups played by the harness through HTTP: each row is its episode's ids exactly as the
    harness ended with them; the loss mask is 1 on the ids the engine drew (with the log-probs the
    calls returned) and 0 on the harness's prompt and answers; each episode's second call first
    sends a re-rendered prompt, refused with a 409 and counted once; a call naming no episode, or
    asking for another temperature, is refused with a 400, and one naming no open episode with a 404."""
    import openai

    import agent_loops
    from jaxreplay.models.transformer import init_params
    from jaxreplay.rollout.actor import make_streaming_actor
    from jaxreplay.tasks.registry import make_task
    from jaxreplay.train.stack import _agent_loop

    config = load_config(DEMO_MT, [*TINY_MT, *HARNESS, loop_options(calls=3, rerender_at=1)])
    validate(config)
    task = make_task(config.task)
    graphdef, params = init_params(config.model, 0)
    tok = task.tokenizer
    episodes = _agent_loop(config, task)
    # a turn ends at EOS or at a digit: the random policy's turns are short enough for 3 calls an episode
    stop_ids = (*tok.eos_ids, *tok.encode("0123456789"))
    actor = make_streaming_actor(graphdef, config, task, params, stop_ids=stop_ids, pad_id=tok.pad_id,
                                 live_vocab=tok.vocab_size, episodes=episodes)
    client = openai.OpenAI(base_url=episodes.base_url, api_key="unused", max_retries=0, timeout=60)
    try:
        with pytest.raises(openai.BadRequestError, match="X-Episode-Id"):
            client.completions.create(model=episodes.model_id, prompt=[3])
        with pytest.raises(openai.BadRequestError, match="temperature 0.5 differs from the run's"):
            client.completions.create(model=episodes.model_id, prompt=[3], temperature=0.5,
                                      extra_headers={"X-Episode-Id": "nope"})
        with pytest.raises(openai.NotFoundError, match="no open episode 'nope'"):
            client.completions.create(model=episodes.model_id, prompt=[3], extra_headers={"X-Episode-Id": "nope"})
        rows, stats = [], []
        for version in range(60):
            got, s = actor.advance(params, version)
            if got is not None:
                rows.append(got)
                stats.append(s)
            if sum(len(r["reward"]) for r in rows) >= 16:
                break
    finally:
        actor.close()
    rows = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    assert len(rows["reward"]) >= 16
    g, p = config.train.group_size, task.prompt_len
    played = {tuple(int(x) for x in eid.split("-")[-2:]): e for eid, e in agent_loops.EPISODES.items()
              if eid.startswith(episodes._prefix)}
    multi_call = refused = 0
    for i, rid in enumerate(rows["rollout_id"]):
        e = played[(int(rid) // g, int(rid) % g)]  # group k = rollout_id // G, row j = rollout_id % G
        real = rows["attention_mask"][i]
        assert rows["tokens"][i][real].tolist() == e["ids"]
        np.testing.assert_array_equal(rows["completion_mask"][i][real], e["model"])  # no client token trained
        assert not rows["completion_mask"][i][:p].any()
        np.testing.assert_allclose(rows["logprobs"][i][rows["completion_mask"][i]], e["logprobs"], rtol=0, atol=1e-6)
        assert (rows["logprobs"][i][~rows["completion_mask"][i]] == 0).all()
        assert rows["policy_version"][i] <= rows["last_version"][i]
        assert rows["reward"][i] == e["reward"]
        multi_call += sum(1 for a, b in zip(e["model"], e["model"][1:]) if a and not b) >= 2
        refused += e["refused"]
    assert multi_call >= 4, "the test needs episodes of 3 calls, the client's tokens between them"
    assert refused > 0 and sum(s["env/errors/rerendered_prompt"] for s in stats) == refused
    assert sum(s["env/errors/exception"] + s["env/errors/timeout"] for s in stats) == 0


def train_loop(tmp_path, name, *overrides):
    from jaxreplay.train.driver import train

    config = load_config(DEMO_MT, [*RUN_MT, *HARNESS, loop_options(lockstep=True, calls=3, rerender_at=1),
                                   f"run.dir={tmp_path / name}", f"warmstart.cache_dir={tmp_path / 'ws'}", *overrides])
    return config, train(config, log=lambda _: None)


@pytest.mark.slow
@pytest.mark.needs_serve
def test_a_run_of_outside_episodes_resumed_counts_what_a_straight_one_does(tmp_path):
    """4 steps straight, and 2 steps then the same command with train.steps=4: every step is
    recorded once with the same episode, token and error counts and the same limiter counters and
    prompt position; the episodes in flight at the checkpoint were played again by their harnesses."""
    same = ["replay.selector=fifo", "train.eval_every=100", "checkpoint.every=2"]
    straight, summary = train_loop(tmp_path, "straight", *same, "train.steps=4")
    train_loop(tmp_path, "resumed", *same, "train.steps=2")
    resumed, resumed_summary = train_loop(tmp_path, "resumed", *same, "train.steps=4")
    a, b = read_metrics(straight.run.dir), read_metrics(resumed.run.dir)
    assert [r["step"] for r in b] == [r["step"] for r in a] == list(range(5))
    assert b[2]["engine/groups_in_flight"] > 0, "the checkpoint should hold episodes in flight"
    counted = ("rollouts/generated", "tokens", "episode/turns", "env/errors/rerendered_prompt",
               "env/errors_total/rerendered_prompt", "replay/inserted", "replay/sampled")
    for ra, rb in zip(a, b, strict=True):
        for key in ra.keys() & rb.keys():
            if key.startswith(counted) or key in ("reward_mean", "loss"):
                assert ra[key] == rb[key], (ra["step"], key)
    for key in ("rollouts/generated", "env/errors_total/rerendered_prompt"):
        assert summary[key] == resumed_summary[key], key
    assert summary["env/errors_total/rerendered_prompt"] > 0
    assert summary["env/errors_total/exception"] == summary["env/errors_total/timeout"] == 0
    assert dataclasses.asdict(straight.environment) == dataclasses.asdict(resumed.environment)


def test_the_verifiers_and_openenv_adapters_wait_on_pins_that_conflict():
    """Why no verifiers 0.4.0 or OpenEnv 0.10.0 adapter ships (docs/serving.md): each requires what
    constraints/default.txt pins otherwise. When a pin moves, this fails: the adapter can be built."""
    from test_train import ROOT

    pins = dict(line.split("==", 1) for line in (ROOT / "constraints" / "default.txt").read_text().split()
                if "==" in line)
    major = lambda name: int(pins[name].split(".")[0])
    assert major("openai") >= 3, "openai < 3 is pinned now: verifiers 0.4.0 (openai>=2.54.0,<3.0.0) may install"
    assert major("pillow") >= 13, "pillow < 13 is pinned now: openenv 0.10.0 (gradio, pillow<13.0) may install"
