"""LoRA (`model.lora`): the adapters' layout, step 0 is the base, only adapters train, the
samplers' log-probs are the learner's, checkpoints hold adapters and refuse another base,
and bad settings are refused at the edge."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.config import ConfigError, LoraConfig, ModelConfig, load_config
from jaxreplay.models import lora
from jaxreplay.models import transformer as T

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_model(targets=ALL, rank=4, alpha=8.0, **kw) -> ModelConfig:
    return ModelConfig(lora=LoraConfig(targets=targets, rank=rank, alpha=alpha), **kw)


def leaves_by_name(tree) -> dict:
    return {"/".join(lora._names(p)): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def with_nonzero_b(params, value=0.05):
    """Adapters as if trained: B no longer zero."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x + value * jnp.cos(jnp.arange(x.size, dtype=x.dtype)).reshape(x.shape)
        if lora._names(p)[-1] == "lora_b" else x, params)


def test_layout_names_shapes_and_peft_init():
    cfg = lora_model(targets=("q_proj", "down_proj"), rank=3)
    _, params = T.init_params(cfg, 0)
    adapters, base = lora.split_adapters(params)
    names = leaves_by_name(adapters)
    assert sorted(names) == sorted(f"layers/{i}/{m}/{p}/lora_{f}" for i in range(cfg.n_layers)
                                   for m, p in (("attn", "q_proj"), ("mlp", "down_proj")) for f in "ab")
    d, hd = cfg.d_model, cfg.head_dim
    assert names["layers/0/attn/q_proj/lora_a"].shape == (d, 3)
    assert names["layers/0/attn/q_proj/lora_b"].shape == (3, cfg.n_heads * hd)
    assert names["layers/1/mlp/down_proj/lora_a"].shape == (cfg.d_ff, 3)
    for name, x in names.items():
        if name.endswith("lora_b"):
            assert not np.any(np.asarray(x)), name  # B = 0: step 0 is the base
        else:  # PEFT's kaiming_uniform(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in)), not all alike
            bound = 1 / np.sqrt(x.shape[0])
            assert np.all(np.abs(np.asarray(x)) <= bound) and np.std(np.asarray(x)) > bound / 3
    # the base's part is the model without LoRA, value for value (the base init ignores the adapters)
    _, plain = T.init_params(lora.base_model_config(cfg), 0)
    assert jax.tree.structure(base) == jax.tree.structure(plain)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(plain)))


def test_no_targets_is_the_plain_model():
    _, params = T.init_params(ModelConfig(), 0)
    adapters, _ = lora.split_adapters(params)
    assert jax.tree.leaves(adapters) == []
    assert lora.count_trainable(params) == T.count_params(params)


def test_step_0_equals_the_base():
    cfg = lora_model()
    g0, base = T.init_params(lora.base_model_config(cfg), 7)
    graphdef, params = T.with_adapters(cfg, base, seed=1)
    tokens = jnp.array([[3, 5, 7, 9, 11, 2], [4, 6, 8, 10, 12, 1]])
    mask = jnp.ones_like(tokens, bool)
    assert np.array_equal(T.forward(g0, base, tokens, mask), T.forward(graphdef, params, tokens, mask))
    # the adapters are live: a non-zero B changes the logits
    assert not np.allclose(T.forward(g0, base, tokens, mask),
                           T.forward(graphdef, with_nonzero_b(params), tokens, mask))


def test_merged_kernels_equal_adapters_on_the_fly():
    cfg = lora_model(rank=2, alpha=5.0)
    graphdef, params = T.init_params(cfg, 0)
    params = with_nonzero_b(params)
    merged = lora.merge_adapters(params, cfg)
    g0, _ = T.abstract_model(lora.base_model_config(cfg))
    tokens = jnp.array([[3, 5, 7, 9, 11, 2]])
    mask = jnp.ones_like(tokens, bool)
    np.testing.assert_allclose(T.forward(g0, merged, tokens, mask), T.forward(graphdef, params, tokens, mask),
                               atol=2e-5)


@pytest.mark.parametrize("override, message", [
    ("model.lora.targets=[q_proj,qkv]", "model.lora.targets[1]: 'qkv' is not one of q_proj"),
    ("model.lora.rank=0", "model.lora.rank: must be > 0"),
    ("model.lora.rank=-2", "model.lora.rank: must be > 0"),
    ("model.lora.alpha=0", "model.lora.alpha: must be > 0"),
    ("model.lora.targets=[v_proj,v_proj]", "model.lora.targets: v_proj is named twice"),
])
def test_bad_settings_refused_in_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.lora.targets=[q_proj]", override])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# Learning: only the adapters train; the samplers' log-probs are the learner's


SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
         "model.d_ff=64", "task.max_digits=2", "model.attention_bias=true"]
LORA = ["model.lora.targets=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]", "model.lora.rank=2"]


def lora_batch(config, advantage=1.0, engine=False):
    """(graphdef, params with trained-looking adapters, a batch the static sampler (or the engine) drew
    from them, with frozen behaviour log-probs)."""
    from jaxreplay.rollout.rollouts import to_device_batch
    from jaxreplay.rollout.sampling import make_sampler
    from jaxreplay.tasks.registry import make_task

    task = make_task(config.task)
    g0, base = T.init_params(lora.base_model_config(config.model), 0)
    graphdef, params = T.with_adapters(config.model, base, seed=1)
    params = with_nonzero_b(params, 0.2)
    s = config.sampling
    prompts, mask = task.encode_prompts(task.train_problems(0, 0, 8))
    if engine:
        from jaxreplay.rollout.engine import JaxEngine, PromptGroup

        eng = JaxEngine(graphdef, config.model, params, slots=4, group_size=2, prompt_len=prompts.shape[1],
                        max_new_tokens=s.max_new_tokens, chunk_steps=3, temperature=s.temperature,
                        stop_ids=task.tokenizer.eos_ids, pad_id=task.tokenizer.pad_id)
        eng.submit([PromptGroup(i, prompts[i], mask[i], jax.random.key(i)) for i in range(4)])
        done = []
        while eng.pending():
            eng.step()
            done += eng.collect()
        r = {f: np.concatenate([getattr(c.rollout, f) for c in sorted(done, key=lambda c: c.tag)])
             for f in ("tokens", "attention_mask", "completion_mask", "logprobs")}
    else:
        sample = make_sampler(graphdef, config.model, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                              stop_ids=task.tokenizer.eos_ids, pad_id=task.tokenizer.pad_id)
        out = jax.device_get(sample(params, prompts, mask, jax.random.PRNGKey(1)))
        r = {f: getattr(out, f) for f in ("tokens", "attention_mask", "completion_mask", "logprobs")}
    batch = {**r, "advantage": np.full(len(r["tokens"]), advantage, np.float32)}
    return graphdef, params, to_device_batch(batch)


def test_only_the_adapters_change_and_only_they_have_optimizer_state():
    from jaxreplay.learn.learner import make_optimizer, make_train_step

    config = load_config(None, SMALL + LORA + ["train.learning_rate=1e-2", "train.warmup_steps=0"])
    graphdef, params, batch = lora_batch(config)
    optimizer = make_optimizer(config.train)
    opt_state = optimizer.init(params)
    adapters, base = lora.split_adapters(params)
    n_adapters = sum(x.size for x in jax.tree.leaves(adapters))
    moments = sum(x.size for x in jax.tree.leaves(opt_state) if x.ndim)  # Adam's mu and nu: 2 per adapter scalar
    assert moments == 2 * n_adapters
    before = jax.tree.map(np.asarray, params)
    new, _, m = make_train_step(graphdef, config, optimizer)(params, opt_state, batch, None)
    assert float(m["grad_norm"]) > 0 and int(m["nonfinite"]) == 0
    new_adapters, new_base = lora.split_adapters(new)
    old_adapters, old_base = lora.split_adapters(before)
    for a, b in zip(jax.tree.leaves(new_base), jax.tree.leaves(old_base)):
        assert np.array_equal(np.asarray(a), b)  # the base is frozen, bit for bit
    changed = [not np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(new_adapters),
                                                                     jax.tree.leaves(old_adapters))]
    assert all(changed)


def test_kl_reference_is_the_base_with_adapters_off():
    """kl_ref is 0 at step 0 (B = 0: the policy is the base), and positive once the adapters moved,
    with no reference copy passed in."""
    from jaxreplay.learn.learner import make_optimizer, make_train_step
    from jaxreplay.learn.trainable import initial_reference

    config = load_config(None, SMALL + LORA + ["train.kl_coef=0.1"])
    graphdef, params, batch = lora_batch(config)
    assert initial_reference(params, config.train.kl_coef) is None
    optimizer = make_optimizer(config.train)
    step = make_train_step(graphdef, config, optimizer)
    zeroed = jax.tree_util.tree_map_with_path(lambda p, x: x * 0 if lora._names(p)[-1] == "lora_b" else x.copy(),
                                              params)  # a copy: the step donates its params
    _, _, m0 = step(zeroed, optimizer.init(zeroed), batch, None)
    assert float(m0["kl_ref"]) == pytest.approx(0.0, abs=1e-7)
    _, _, m1 = step(params, optimizer.init(params), batch, None)
    assert float(m1["kl_ref"]) > 1e-4


@pytest.mark.parametrize("engine", [False, True], ids=["static", "engine"])
@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_behaviour_logprobs_equal_the_learners(engine, dtype, tolerance):
    """Rollouts drawn with base + adapters (on the fly, through the decode step's fused projections)
    score the same under the learner's forward pass: ratio 1 within float32 (or bfloat16) rounding."""
    from jaxreplay.learn.scoring import sequence_scores

    config = load_config(None, SMALL + LORA + [f"model.param_dtype={dtype}", f"model.compute_dtype={dtype}",
                                               "sampling.temperature=0.7"])
    graphdef, params, batch = lora_batch(config, engine=engine)
    h, unembed = T.score_hidden(graphdef, params, batch["tokens"], batch["attention_mask"])
    learner, _ = sequence_scores(h, batch["tokens"], unembed, temperature=0.7, with_entropy=False)
    completion = np.asarray(batch["completion_mask"])
    assert completion.sum() > 0
    np.testing.assert_allclose(np.asarray(batch["logprobs"]), np.where(completion, np.asarray(learner), 0.0),
                               atol=tolerance)
    # the adapters matter: the base alone scores these tokens differently
    _, base = lora.split_adapters(params)
    g0, _ = T.abstract_model(lora.base_model_config(config.model))
    h0, unembed0 = T.score_hidden(g0, base, batch["tokens"], batch["attention_mask"])
    base_lp, _ = sequence_scores(h0, batch["tokens"], unembed0, temperature=0.7, with_entropy=False)
    assert np.abs(np.where(completion, np.asarray(base_lp) - np.asarray(learner), 0)).max() > 10 * tolerance


# ---------------------------------------------------------------------------------------------
# Checkpoints: the adapters and their optimizer state, the base by its checksum; exact resume


def test_a_checkpoint_of_another_base_is_refused_in_one_line():
    from jaxreplay.cli import _bad_input
    from jaxreplay.train.checkpoint import OtherBase, base_digest, restored_params, saved_params

    cfg = lora_model(targets=("q_proj",))
    _, params = T.init_params(cfg, 0)
    _, other = T.init_params(cfg, 1)
    assert base_digest(params) != base_digest(other) and len(base_digest(params)) == 16
    assert base_digest(T.init_params(lora.base_model_config(cfg), 0)[1]) == ""  # no LoRA: nothing to check
    saved = saved_params(with_nonzero_b(params))
    assert jax.tree.structure(saved) == jax.tree.structure(lora.split_adapters(params)[0])
    back = restored_params(params, saved, base_digest(params), base_digest(params), "ckpt/2")
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(with_nonzero_b(params))))
    with pytest.raises(OtherBase) as e:
        restored_params(other, saved, base_digest(params), base_digest(other), "ckpt/2")
    assert "\n" not in str(e.value) and str(e.value).startswith("ckpt/2 was trained on a base")
    assert _bad_input(e.value)  # the CLI's exit code 2


@pytest.mark.slow
def test_lora_resume_is_exact_the_checkpoint_holds_adapters_and_a_changed_base_is_refused(tmp_path):
    """2 steps, then the same command with train.steps=4, equals 4 steps straight (test_train's
    exact-resume settings); the checkpoint holds the adapters and their Adam moments, not the base;
    a resume whose warm-start base was replaced since is refused."""
    from test_train import DEMO, TINY

    from jaxreplay.train.checkpoint import Checkpointer, OtherBase
    from jaxreplay.train.driver import train
    from jaxreplay.train.metrics import read_metrics
    from jaxreplay.train.warmstart import _write_files, cache_key, cache_root, warmstart_settings

    settings = [*TINY, *LORA, "model.n_layers=2", "replay.selector=fifo", "train.batch_size=4",
                "replay.samples_per_insert=1", "replay.error_buffer=3", "replay.max_size=16",
                "replay.min_size_to_sample=16", "train.loss=asymre", "train.advantage=group_centered",
                "task.train_size=8", "task.eval_size=8", "train.eval_every=1000", "train.learning_rate=1e-2",
                f"warmstart.cache_dir={tmp_path / 'cache'}"]

    def run(name, steps):
        config = load_config(DEMO, [*settings, f"train.steps={steps}", f"run.dir={tmp_path / name}"])
        return config, train(config, log=lambda _: None)

    straight, _ = run("straight", 4)
    run("resumed", 2)
    resumed, _ = run("resumed", 4)
    a, b = read_metrics(straight.run.dir), read_metrics(resumed.run.dir)
    assert [r["step"] for r in b] == list(range(5))
    assert sum(r["grad_norm"] > 0 for r in a[1:]) >= 2, "the adapters must train for this to test anything"
    for ra, rb in zip(a[1:], b[1:]):
        for key in ("loss", "grad_norm", "replay/samples", "tokens/generated"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-6), (ra["step"], key)

    metas = []
    for config in (straight, resumed):
        ckpt = Checkpointer(f"{config.run.dir}/checkpoints", keep=2)
        metas.append(ckpt.meta(4))
        ckpt.close()
    meta = metas[1]
    saved = [n for n in meta["checksums"]["leaves"] if n.startswith("params/")]
    assert saved and all("/lora_a" in n or "/lora_b" in n for n in saved)  # no base array is saved
    assert len(meta["base_digest"]) == 16 and metas[0]["base_digest"] == meta["base_digest"]
    # the same adapters and Adam moments, array for array (their checksums)
    arrays = lambda m: {n: d for n, d in m["checksums"]["leaves"].items() if n.startswith(("params/", "opt_state/"))}
    assert arrays(metas[0]) == arrays(meta) and len(arrays(meta)) > len(saved)

    # `jaxreplay eval` / `export` read the policy back: the checkpoint's adapters on the warm start's base
    from jaxreplay.train.checkpoint import base_digest, digests
    from jaxreplay.train.eval import load_policy

    _, _, policy, _, where = load_policy(resumed, checkpoint=resumed.run.dir)
    assert where["step"] == 4 and base_digest(policy) == meta["base_digest"]
    read = {f"params/{n}": d for n, d in digests(lora.split_adapters(policy)[0]).items()}
    assert read == {n: d for n, d in meta["checksums"]["leaves"].items() if n.startswith("params/")}

    # The warm start the base came from is replaced (another set of weights under the same entry):
    entry = f"{cache_root(resumed)}/{cache_key(lora.base_config(resumed))}"
    _, other = T.init_params(lora.base_model_config(resumed.model), 5)
    _write_files(entry, warmstart_settings(lora.base_config(resumed)), other)
    with pytest.raises(OtherBase, match="was trained on a base whose checksum is"):
        run("resumed", 6)
    with pytest.raises(OtherBase):
        load_policy(resumed, checkpoint=resumed.run.dir)


def test_a_weight_update_moves_the_adapters_and_the_base_once():
    from jaxreplay.models import sharding
    from jaxreplay.rollout.weights import weight_sync

    cfg = lora_model(targets=("q_proj", "up_proj"))
    _, params = T.init_params(cfg, 0)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), sharding.AXES)
    to_actor = weight_sync(sharding.param_shardings(mesh, T.abstract_params(cfg)))
    first = to_actor(params)
    trained = with_nonzero_b(params)
    second = to_actor(trained)
    (a1, b1), (a2, b2) = lora.split_adapters(first), lora.split_adapters(second)
    assert all(x is y for x, y in zip(jax.tree.leaves(b1), jax.tree.leaves(b2)))  # the base was not moved again
    want = jax.tree.leaves(lora.split_adapters(trained)[0])
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a2), want))  # the adapters were
    assert not all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a1), want))
    _, plain = T.init_params(lora.base_model_config(cfg), 0)  # without LoRA: every parameter, every time
    to_plain = weight_sync(sharding.param_shardings(mesh, T.abstract_params(lora.base_model_config(cfg))))
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(to_plain(plain)), jax.tree.leaves(plain)))


@pytest.mark.slow
def test_lora_on_an_hf_base_trains_adapters_and_refuses_a_changed_base_directory(tmp_path):
    """model.hf_path + model.lora: the imported weights are the frozen base (the policy read back is
    exactly them plus the trained adapters); after the model directory's weights change, a resume
    is refused in one line."""
    import json

    from tiny_hf import write_model

    from jaxreplay.models.hf import load_hf_model
    from jaxreplay.train.checkpoint import OtherBase
    from jaxreplay.train.driver import train
    from jaxreplay.train.eval import load_policy

    hf = write_model(tmp_path / "hf", seed=0)
    for split, n in [("train", 16), ("test", 4)]:
        (tmp_path / f"{split}.jsonl").write_text("".join(
            json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)[0]}) + "\n" for i in range(n)))
    settings = [
        f"model.hf_path={hf}", "model.max_seq_len=40", "task.name=jsonl", f"task.path={tmp_path}/{{split}}.jsonl",
        "task.reward=exact_match", "task.max_prompt_len=32", "warmstart.steps=0", "sampling.max_new_tokens=2",
        "train.batch_size=16", "train.prompts_per_step=4", "train.group_size=4", "train.eval_every=1000",
        "train.learning_rate=1e-2", "train.warmup_steps=0", "train.loss=asymre", "train.advantage=group_centered",
        "replay.max_size=64", "replay.min_size_to_sample=16", "checkpoint.every=2", "run.progress_bar=false",
        f"run.dir={tmp_path / 'run'}", "model.lora.targets=[q_proj,v_proj,down_proj]", "model.lora.rank=2"]
    config = load_config(None, [*settings, "train.steps=2"])
    assert train(config, log=lambda _: None)["steps"] == 2

    _, _, imported = load_hf_model(hf)
    _, _, policy, _, _ = load_policy(config, checkpoint=str(tmp_path / "run"))
    adapters, base = lora.split_adapters(policy)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(imported)))
    assert any(np.any(np.asarray(b)) for b in jax.tree.leaves(adapters))  # B moved off zero

    write_model(tmp_path / "hf", seed=1)  # the directory's weights change under the run
    with pytest.raises(OtherBase, match="was trained on a base whose checksum is"):
        train(load_config(None, [*settings, "train.steps=4"]), log=lambda _: None)
