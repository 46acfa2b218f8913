"""GRPO groups stay whole whatever the learner's batch size (the failure of Tunix #816, where
micro-batches smaller than the group silently mixed completions of different prompts)."""

import numpy as np

from jaxreplay.config import load_config
from jaxreplay.models.transformer import init_params
from jaxreplay.rollout.actor import Actor
from jaxreplay.rollout.advantages import group_normalized
from jaxreplay.rollout.sampling import make_sampler
from jaxreplay.tasks import rewards as rewards_module
from jaxreplay.tasks.base import ByteTokenizer
from jaxreplay.tasks.datasets import DatasetTask

PAPER_SHAPES = ["train.batch_size=60", "train.group_size=16", "train.prompts_per_step=4", "replay.max_size=256",
                "replay.min_size_to_sample=64"]
TINY = ["task.name=jsonl", "task.path=unused/{split}.jsonl", "task.max_prompt_len=8", "warmstart.steps=0",
        "model.vocab_size=259", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
        "model.head_dim=16", "model.d_ff=64", "model.max_seq_len=12", "sampling.max_new_tokens=4"]


def test_batch_60_with_group_16_keeps_every_group_whole(monkeypatch):
    """The actor samples prompts_per_step x G rows in one call and freezes each rollout's advantage
    over its own group, so a learner batch of 60 (not a multiple of 16) never regroups anything."""
    monkeypatch.setitem(rewards_module.REWARDS, "even_first_byte",
                        lambda completion, _: float(bool(completion) and ord(completion[0]) % 2 == 0))
    config = load_config(None, [*TINY, *PAPER_SHAPES, "task.reward=even_first_byte"])
    records = {"train": [(f"{a}+{a}=", str(2 * a)) for a in range(4)], "test": [("1+1=", "2")]}
    task = DatasetTask(config.task, ByteTokenizer(), records=records)
    graphdef, params = init_params(config.model, 0)
    tok = task.tokenizer
    sample = make_sampler(graphdef, config.model, max_new_tokens=4, stop_ids=tok.eos_ids, pad_id=tok.pad_id)
    items, _ = Actor(config, task, sample).act(params, policy_version=0, actor_step=0)

    prompts, _ = task.encode_prompts(task.train_problems(config.run.seed, 0, 4))
    tokens = items["tokens"].reshape(4, 16, -1)
    rewards, advantages = items["reward"].reshape(4, 16), items["advantage"].reshape(4, 16)
    assert len(np.unique(prompts, axis=0)) == 4
    for g in range(4):
        assert (tokens[g, :, :task.prompt_len] == prompts[g]).all()  # one prompt per group
        np.testing.assert_allclose(advantages[g], group_normalized(rewards[g][None])[0], rtol=1e-6)
    assert any(0 < r.mean() < 1 for r in rewards), "mixed rewards are needed for this to test anything"
