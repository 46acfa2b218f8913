"""skyrl-gym's multi-turn GSM8K through the whole stack: a tiny Qwen2-shaped HF model with a ChatML
template, episodes in the engine (skyrl-gym's answers rendered by the template after the model's own
ids), then two training steps."""

import json

import numpy as np
import pytest
import yaml

from jaxreplay.config import load_config
from jaxreplay.models.tokenizer import load_tokenizer
from jaxreplay.models.transformer import init_params
from jaxreplay.rollout.actor import make_streaming_actor
from jaxreplay.tasks.registry import make_task
from jaxreplay.train.driver import train
from jaxreplay.train.metrics import read_metrics
from jaxreplay.train.stack import resolved_model

from test_multiturn import DEMO_MT
from tiny_hf import write_model

pytestmark = [pytest.mark.needs_skyrl, pytest.mark.slow]

ASKED_AGAIN = "'####ANSWER'"  # skyrl-gym's gsm8k_multi_turn asks for this after a wrong turn (spaces aside)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("skyrl")
    for split, n in (("train", 32), ("test", 8)):
        (tmp / f"{split}.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n"
                                                    for i in range(n)))
    raw = yaml.safe_load(DEMO_MT.read_text())
    raw.update(
        model={"hf_path": str(write_model(tmp / "hf", max_seq_len=416)), "max_seq_len": 416},
        task={"name": "jsonl", "path": str(tmp / "{split}.jsonl"), "reward": "exact_match", "max_prompt_len": 32,
              "eval_size": 8},
        environment={"name": "jaxreplay.tasks.skyrl_env:SkyRLEnvironment", "options": {"max_turns": 2},
                     "max_turns": 2, "workers": 0},
        warmstart={"steps": 0})
    (tmp / "skyrl.yaml").write_text(yaml.safe_dump(raw))
    # A random model ends a turn with its EOS (<|im_end|>, 1 of 101 live ids) after ~100 tokens: room for
    # two turns and skyrl-gym's ~80-token request between them. (This model directory's tokenizer loads
    # without whitespace: the template's and skyrl-gym's spaces and newlines are dropped alike everywhere.)
    return load_config(tmp / "skyrl.yaml", [
        "train.prompts_per_step=4", "train.group_size=4", "sampling.engine_chunk_steps=8",
        "sampling.max_new_tokens=384", "train.steps=2", "train.batch_size=8", "replay.min_size_to_sample=8",
        "replay.max_size=64", "train.eval_every=2", "checkpoint.every=2", "run.progress_bar=false",
        f"run.dir={tmp / 'run'}"])


def test_skyrl_answers_enter_through_the_chat_template_and_are_never_trained(config):
    config = resolved_model(config)
    tok = load_tokenizer(config.model.hf_path, vocab_size=config.model.vocab_size)
    task = make_task(config.task, tok)
    graphdef, params = init_params(config.model, 0)
    actor = make_streaming_actor(graphdef, config, task, params, stop_ids=tok.eos_ids, pad_id=tok.pad_id,
                                 live_vocab=tok.vocab_size)
    rows, stats = [], []
    for _ in range(400):
        got, s = actor.advance(params, 0)
        if got is not None:
            rows.append(got)
            stats.append(s)
        if len(rows) == 2:
            break
    actor.episodes.pool.shutdown()
    assert rows, "no group completed"
    p, asked = task.prompt_len, 0
    ends = set(tok.eos_ids)
    for row in rows:
        for tokens, attention, completion in zip(row["tokens"], row["attention_mask"], row["completion_mask"]):
            body, trained = tokens[p:][attention[p:]], completion[p:][attention[p:]]
            assert trained[0] and tok.hf.decode(tokens[:p][attention[:p]]).startswith("<|im_start|>user")
            for i in range(1, len(body)):
                if trained[i - 1] and not trained[i]:  # the model's turn ended with its own EOS, not closed again
                    assert body[i - 1] in ends and body[i] not in ends
            env_text = tok.hf.decode(body[~trained])
            if ASKED_AGAIN in "".join(env_text.split()):  # its request in a user turn, then the next assistant turn
                asked += 1
                assert env_text.startswith("<|im_start|>user") and env_text.endswith("<|im_start|>assistant")
    assert asked, "no episode reached skyrl-gym's second turn"
    assert all(1 <= s["episode/turns"] <= 2 for s in stats)


def test_skyrl_trains_a_few_steps(config):
    summary = train(config, log=lambda _: None)
    records = read_metrics(config.run.dir)
    assert summary["steps"] == 2 and [r["step"] for r in records] == [0, 1, 2]
    assert all(np.isfinite(r["loss"]) for r in records[1:])
    assert records[-1]["tokens/trained"] > 0 and "eval/accuracy" in records[-1]
