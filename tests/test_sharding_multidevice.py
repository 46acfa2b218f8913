"""Sharded == single device: the same loss, gradient norm, updated params and greedy generations.

Needs 8 devices, and XLA reads its device count once, before JAX initialises: so
tests/test_sharding.py runs this file in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8. Run directly, it skips unless
JAX sees 8 devices.
"""

import jax
import numpy as np
import pytest

from jaxreplay.compat import split_kv_gap, value_of
from jaxreplay.config import ConfigError, MeshConfig, load_config
from jaxreplay.learn.learner import make_optimizer, make_train_step
from jaxreplay.models import sharding
from jaxreplay.models.transformer import init_params
from jaxreplay.rollout.rollouts import to_device_batch
from jaxreplay.rollout.sampling import make_sampler
from jaxreplay.tasks.registry import make_task

pytestmark = pytest.mark.skipif(jax.device_count() != 8, reason="needs 8 devices: run through tests/test_sharding.py")

MESHES = [(8, 1, 1), (2, 2, 2), (1, 4, 2), (1, 2, 4)]
ROWS = 16
# KL on so the reference params' shardings are exercised too; no warm-up so step 1 moves.
OVERRIDES = ["train.kl_coef=0.05", "train.warmup_steps=0", "train.learning_rate=1e-3", f"train.batch_size={ROWS}",
             "train.prompts_per_step=2"]


@pytest.fixture(scope="module")
def setup():
    config = load_config(None, OVERRIDES)
    task = make_task(config.task)
    graphdef, params = init_params(config.model, 0)
    prompts, mask = task.encode_prompts(task.train_problems(0, 0, ROWS))
    tok = task.tokenizer
    kwargs = dict(max_new_tokens=config.sampling.max_new_tokens, stop_ids=tok.eos_ids, pad_id=tok.pad_id)
    r = jax.device_get(make_sampler(graphdef, config.model, **kwargs)(params, prompts, mask, jax.random.PRNGKey(1)))
    advantage = np.random.default_rng(0).standard_normal(ROWS).astype(np.float32)
    batch = {"tokens": r.tokens, "attention_mask": r.attention_mask, "completion_mask": r.completion_mask,
             "logprobs": r.logprobs, "advantage": advantage}
    return config, graphdef, jax.device_get(params), (prompts, mask), batch, kwargs


def train_two_steps(config, graphdef, params, batch, mesh):
    optimizer = make_optimizer(config.train)
    opt_state = optimizer.init(params)
    ref = params
    if mesh is not None:
        params, opt_state, ref = (sharding.shard_params(t, mesh) for t in (params, opt_state, ref))
    step = make_train_step(graphdef, config, optimizer, mesh)
    metrics = []
    for _ in range(2):
        params, opt_state, m = step(params, opt_state, to_device_batch(batch), ref)
        metrics.append(jax.device_get(m))
    return params, metrics


def greedy(config, graphdef, params, prompts, kwargs, mesh):
    if mesh is not None:
        params = sharding.shard_params(params, mesh)
    sample = make_sampler(graphdef, config.model, greedy=True, mesh=mesh, **kwargs)
    return sample(params, *prompts, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def reference(setup):
    config, graphdef, params, prompts, batch, kwargs = setup
    new_params, metrics = train_two_steps(config, graphdef, params, batch, None)
    return jax.device_get(new_params), metrics, jax.device_get(greedy(config, graphdef, params, prompts, kwargs, None))


def max_abs_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a),
                                                                                   jax.tree.leaves(b)))


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_train_step_matches_single_device(setup, reference, shape):
    config, graphdef, params, _, batch, _ = setup
    ref_params, ref_metrics, _ = reference
    mesh = sharding.make_mesh(MeshConfig(*shape))
    new_params, metrics = train_two_steps(config, graphdef, params, batch, mesh)
    for got, want in zip(metrics, ref_metrics):
        for key in ("loss", "grad_norm", "kl_ref", "entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    diff = max_abs_diff(new_params, ref_params)
    print(f"mesh {shape}: |loss diff| {abs(metrics[-1]['loss'] - ref_metrics[-1]['loss']):.2e} "
          f"|grad_norm diff| {abs(metrics[-1]['grad_norm'] - ref_metrics[-1]['grad_norm']):.2e} "
          f"max |param diff| after 2 steps {diff:.2e}")
    # Adam divides by sqrt(v): a gradient entry near zero can move by a visible fraction of the
    # learning rate on a float reordering (5.1e-5 of lr 1e-3 on XLA 0.12's CPU reductions), so
    # params agree to a tenth of one step.
    assert diff < 0.1 * config.train.learning_rate


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 4, 2)], ids=lambda s: "x".join(map(str, s)))
def test_a_micro_batched_rematerialised_chunked_step_matches_the_plain_single_device_one(setup, reference, shape):
    """Micro-batches of 8 rows (2 per data-parallel shard), remat and chunked logits, sharded:
    the plain single-device step's numbers."""
    config, graphdef, params, _, batch, _ = setup
    ref_params, ref_metrics, _ = reference
    config = load_config(None, OVERRIDES + ["train.micro_batch_size=8", "train.remat=dots",
                                            "train.logits_chunk_size=5"])
    mesh = sharding.make_mesh(MeshConfig(*shape))
    new_params, metrics = train_two_steps(config, graphdef, params, batch, mesh)
    for got, want in zip(metrics, ref_metrics):
        for key in ("loss", "grad_norm", "kl_ref", "entropy", "pg_clipfrac"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert max_abs_diff(new_params, ref_params) < 0.1 * config.train.learning_rate


def test_a_micro_batch_not_divisible_by_data_parallelism_is_a_config_error():
    config = load_config(None, OVERRIDES + ["mesh.data=8", "train.micro_batch_size=4"])
    with pytest.raises(ConfigError, match="train.micro_batch_size"):
        sharding.mesh_for(config)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_greedy_generations_match_single_device(setup, reference, shape):
    config, graphdef, params, prompts, _, kwargs = setup
    want = reference[2]
    mesh = sharding.make_mesh(MeshConfig(*shape))
    got = greedy(config, graphdef, params, prompts, kwargs, mesh)
    assert got.tokens.sharding.spec == sharding.batch_sharding(mesh).spec
    got = jax.device_get(got)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.completion_mask, want.completion_mask)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_params_and_optimizer_state_are_actually_split(setup):
    """(1, 4, 2): an MLP kernel [embed, mlp] is split 4 ways by fsdp and 2 by tensor, and so
    are its Adam moments; the scalar step count is replicated."""
    config, _, params, _, _, _ = setup
    mesh = sharding.make_mesh(MeshConfig(1, 4, 2))
    optimizer = make_optimizer(config.train)
    opt_state = sharding.shard_params(optimizer.init(params), mesh)
    params = sharding.shard_params(params, mesh)
    kernel = value_of(params["layers"][0]["mlp"]["up_proj"]["kernel"])
    d, f = config.model.d_model, config.model.d_ff
    assert kernel.sharding.shard_shape(kernel.shape) == (d // 4, f // 2)
    moments = [x for x in jax.tree.leaves(opt_state) if x.shape == (d, f)]
    assert moments and all(m.sharding.shard_shape(m.shape) == (d // 4, f // 2) for m in moments)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(opt_state) if x.ndim == 0)


def test_mesh_that_does_not_fit_is_a_config_error():
    with pytest.raises(ConfigError, match="mesh.data"):
        sharding.make_mesh(MeshConfig(4, 4, 1))
    with pytest.raises(ConfigError, match="mesh.tensor"):
        sharding.make_mesh(MeshConfig(3, 1, -1))
    assert sharding.make_mesh(MeshConfig(2, -1, 2)).shape["fsdp"] == 2


def test_batch_not_divisible_by_data_parallelism_is_a_config_error():
    config = load_config(None, ["mesh.data=8", "train.batch_size=12", "replay.error_buffer=16"])
    with pytest.raises(ConfigError, match="train.batch_size"):
        sharding.mesh_for(config)


def engine_run(config, graphdef, params, prompts, kwargs, mesh, slots=8, group_size=4):
    """A greedy engine run over the prompts (fewer slots than rows, so groups start as others
    stop), its weights changed after the second chunk: completions by tag, and the engine.
    Greedy, on logits sharpened 20x (the final norm's scale), so that no near-tie between an
    untrained model's nearly flat logits can flip on a sharded reduction's last bits."""
    from jaxreplay.rollout.engine import JaxEngine, PromptGroup

    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 20 if "final_norm" in jax.tree_util.keystr(path) else x, params)
    moved = jax.tree.map(lambda x: x * 1.05, params)
    if mesh is not None:
        params, moved = sharding.shard_params(params, mesh), sharding.shard_params(moved, mesh)
    engine = JaxEngine(graphdef, config.model, params, slots=slots, group_size=group_size,
                       prompt_len=prompts[0].shape[1], max_new_tokens=kwargs["max_new_tokens"], chunk_steps=4,
                       greedy=True, stop_ids=kwargs["stop_ids"], pad_id=kwargs["pad_id"], mesh=mesh)
    tokens, mask = prompts
    engine.submit([PromptGroup(i, tokens[i], mask[i], jax.random.fold_in(jax.random.key(7), i))
                   for i in range(len(tokens) // 2)])
    done, chunk = {}, 0
    while engine.pending():
        if chunk == 2:
            engine.update_weights(moved, 1)
        engine.step()
        done.update((c.tag, c) for c in engine.collect())
        chunk += 1
    return done, engine


@pytest.fixture(scope="module")
def engine_reference(setup):
    config, graphdef, params, prompts, _, kwargs = setup
    return engine_run(config, graphdef, params, prompts, kwargs, None)[0]


@pytest.mark.parametrize("shape", [*MESHES, (2, 1, 4)], ids=lambda s: "x".join(map(str, s)))
def test_the_engine_on_a_mesh_draws_what_it_draws_on_one_device(setup, engine_reference, shape):
    """Same tokens, same per-token versions, log-probs within 1e-5, with weights changed mid-sequence.
    Where the tier miscomputes such a mesh (compat.split_kv_gap), a run is refused it instead."""
    config, graphdef, params, prompts, _, kwargs = setup
    mesh = sharding.make_mesh(MeshConfig(*shape))
    if split_kv_gap(shape[2], config.model.n_kv_heads, sharding.data_parallelism(mesh)):
        sized = load_config(None, OVERRIDES + [f"mesh.data={shape[0]}", f"mesh.fsdp={shape[1]}",
                                               f"mesh.tensor={shape[2]}"])
        with pytest.raises(ConfigError, match="mesh.tensor: jax .* miscomputes attention"):
            sharding.mesh_for(sized)
        return
    done, engine = engine_run(config, graphdef, params, prompts, kwargs, mesh)
    assert sorted(done) == sorted(engine_reference)
    versions = np.concatenate([done[t].token_versions for t in sorted(done)])
    assert {0, 1} <= set(versions.ravel().tolist()), "the fixture should draw under both weight versions"
    for tag, want in engine_reference.items():
        got = done[tag]
        np.testing.assert_array_equal(got.rollout.tokens, want.rollout.tokens)
        np.testing.assert_array_equal(got.token_versions, want.token_versions)
        np.testing.assert_allclose(got.rollout.logprobs, want.rollout.logprobs, atol=1e-5)


def test_the_engines_pool_is_split_like_a_batch_and_its_cache_like_the_samplers(setup):
    """(2, 2, 2): 8 slots split 4 ways (data x fsdp), the cache's 2 kv heads 2 ways (tensor), so
    each device holds an eighth of the pool's cache; the prefix entries are replicated. The
    layout survives the programs that write the pool."""
    config, graphdef, params, prompts, _, kwargs = setup
    mesh = sharding.make_mesh(MeshConfig(2, 2, 2))
    _, engine = engine_run(config, graphdef, params, prompts, kwargs, mesh)
    k = engine.pool.cache.k[0]
    assert k.shape[:2] == (8, 2)
    assert {s.data.shape[:2] for s in k.addressable_shards} == {(2, 1)}
    assert {s.data.shape for s in engine.pool.tokens.addressable_shards} == {(2, engine.pool.tokens.shape[1])}
    assert engine.prefixes.cache.k[0].sharding.is_fully_replicated


def test_multi_turn_answers_on_a_mesh_are_prefilled_a_devices_rows_a_call_as_on_one_device():
    """16 slots over 8 data-parallel devices: an answer-prefill call takes at most the 2 rows of
    one device (its gather is held whole on every device), so the 10-id answers of 16 rows that
    arrive together take 8 calls; the episodes are those of one device, where one call takes
    them all. Every id ends a turn, so every row's answer comes back at the same boundary."""
    from jaxreplay.rollout.engine import answer_prefill_rows
    from test_multiturn import LONG_ANSWERS, by_id, run_episodes

    mesh = sharding.make_mesh(MeshConfig(8, 1, 1))
    assert (answer_prefill_rows(16, mesh), answer_prefill_rows(16), answer_prefill_rows(12)) == (2, 16, 16)
    every_id = tuple(range(19))  # the demo's character vocabulary
    on_mesh, on_one = [], []
    *_, got, _ = run_episodes(LONG_ANSWERS, mesh=mesh, sharpen=20.0, engine_stats=on_mesh, stop_ids=every_id)
    *_, want, _ = run_episodes(LONG_ANSWERS, sharpen=20.0, engine_stats=on_one, stop_ids=every_id)
    assert on_mesh[0].prefilled_tokens == on_one[0].prefilled_tokens > 0
    assert on_mesh[0].answer_prefills == 8 * on_one[0].answer_prefills > 0
    got, want = by_id(got), by_id(want)
    assert sorted(got) == sorted(want) and len(got) >= 16
    for i in want:
        for k in ("tokens", "attention_mask", "completion_mask", "policy_version", "reward"):
            np.testing.assert_array_equal(got[i][k], want[i][k], err_msg=f"{k} of rollout {i}")
        np.testing.assert_allclose(got[i]["logprobs"], want[i]["logprobs"], atol=1e-5)
