"""The mixture-of-experts MLP (jaxreplay/models/moe.py) against plain per-token references: dropless
ragged_dot dispatch equals computing each token's k experts one by one, HF's load-balancing loss,
HF's sparse-layer rule, routing replay, and the config's checks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxreplay.config import ConfigError, ModelConfig, validate
from jaxreplay.models import moe
from jaxreplay.models.transformer import forward, init_params, routed_score_hidden

ROOT = Path(__file__).resolve().parents[1]

CFG = ModelConfig(vocab_size=64, d_model=16, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=24,
                  max_seq_len=32, qk_norm=True, n_experts=6, experts_per_token=2, moe_d_ff=12, moe_sparse_step=1,
                  moe_dense_layers=(1,))


def _layer(cfg: ModelConfig = CFG, seed: int = 0) -> moe.MoE:
    return moe.MoE(cfg, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(params=seed))


def _reference(layer: moe.MoE, x: np.ndarray, norm_topk: bool) -> np.ndarray:
    """Each token through its top-k experts one at a time, in numpy float64."""
    router = np.asarray(layer.router.kernel[...], np.float64)
    gate, up, down = (np.asarray(w[...], np.float64) for w in (layer.experts.gate_proj, layer.experts.up_proj,
                                                                 layer.experts.down_proj))
    out = np.zeros_like(x, np.float64)
    for n, token in enumerate(x.astype(np.float64)):
        logits = token @ router
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        chosen = np.argsort(-probs)[:layer.top_k]
        weights = probs[chosen] / (probs[chosen].sum() if norm_topk else 1.0)
        for e, w in zip(chosen, weights):
            g = token @ gate[e]
            out[n] += w * (((g / (1 + np.exp(-g))) * (token @ up[e])) @ down[e])
    return out


@pytest.mark.parametrize("norm_topk, dispatch", [(True, "ragged_dot"), (False, "ragged_dot"), (True, "dense")])
def test_dropless_dispatch_equals_each_token_through_its_top_k_experts(norm_topk, dispatch):
    layer = _layer(dataclasses.replace(CFG, moe_norm_topk=norm_topk, moe_dispatch=dispatch))
    x = np.random.default_rng(0).normal(size=(2, 7, CFG.d_model)).astype(np.float32)
    out, routing = layer(jnp.asarray(x))
    assert out.shape == x.shape and routing.logits.shape == (2, 7, 6) and routing.experts.shape == (2, 7, 2)
    np.testing.assert_allclose(np.asarray(out).reshape(-1, CFG.d_model), _reference(layer, x.reshape(-1, 16),
                                                                                      norm_topk), atol=1e-5)


@pytest.mark.parametrize("dispatch", ["ragged_dot", "dense"])
def test_every_token_is_computed_even_when_all_pick_one_expert(dispatch):
    """Dropless: no capacity, so a router that sends every token to the same experts drops none."""
    graphdef, state = nnx.split(_layer(dataclasses.replace(CFG, moe_dispatch=dispatch)))
    favour = lambda path, x: jnp.zeros_like(x).at[:, 3].set(5.0).at[:, 1].set(4.0) if "router" in \
        jax.tree_util.keystr(path) else x
    layer = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(favour, state))
    x = np.abs(np.random.default_rng(1).normal(size=(40, CFG.d_model))).astype(np.float32)
    out, routing = layer(jnp.asarray(x))
    assert set(np.unique(np.asarray(routing.experts))) == {1, 3}
    np.testing.assert_allclose(np.asarray(out), _reference(layer, x, True), atol=1e-5)


def test_replayed_routes_override_the_router_and_keep_its_gradient():
    layer = _layer()
    x = jnp.asarray(np.random.default_rng(2).normal(size=(5, CFG.d_model)).astype(np.float32))
    _, own = layer(x)
    routes = (own.experts + 1) % CFG.n_experts  # other experts than the router's
    out, replayed = layer(x, routes)
    np.testing.assert_array_equal(np.asarray(replayed.experts), np.asarray(routes))
    assert not np.allclose(np.asarray(out), np.asarray(layer(x)[0]))
    graphdef, state = nnx.split(layer)
    grads = jax.grad(lambda s: jnp.sum(nnx.merge(graphdef, s)(x, routes)[0] ** 2))(state)
    from jaxreplay.compat import value_of

    assert float(jnp.abs(value_of(grads["router"]["kernel"])).max()) > 0


def _hf_load_balancing_loss(logits: np.ndarray, mask: np.ndarray, top_k: int) -> float:
    """transformers' `load_balancing_loss_func` with an attention mask, transcribed in numpy: gate logits
    of every layer concatenated [L * B * T, E]."""
    n_layers, b, t, e = logits.shape
    flat = logits.reshape(-1, e)
    probs = np.exp(flat - flat.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1)[:, :top_k]
    expert_mask = np.eye(e)[chosen]  # [N, k, E]
    m = np.broadcast_to(mask[None], (n_layers, b, t)).reshape(-1)
    tokens_per_expert = (expert_mask * m[:, None, None]).sum(0) / m.sum()
    router_prob = (probs * m[:, None]).sum(0) / m.sum()
    return float(np.sum(tokens_per_expert * router_prob[None]) * e)


def test_load_balancing_loss_is_hf_s_over_real_tokens():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2, 3, 5, 6)).astype(np.float32)
    mask = np.ones((3, 5), bool)
    mask[0, 3:] = False
    ours = float(moe.load_balancing_loss(jnp.asarray(logits), jnp.asarray(mask), 2))
    assert ours == pytest.approx(_hf_load_balancing_loss(logits, mask, 2), rel=1e-5)
    # padding does not count: the masked positions' logits change nothing
    logits[:, 0, 3:] = 50.0
    assert float(moe.load_balancing_loss(jnp.asarray(logits), jnp.asarray(mask), 2)) == pytest.approx(ours, rel=1e-5)


def test_sparse_layers_follow_hf_s_step_and_dense_list():
    assert moe.sparse_layers(CFG) == (0, 2)
    assert moe.sparse_layers(dataclasses.replace(CFG, moe_sparse_step=2, moe_dense_layers=())) == (1,)
    assert moe.sparse_layers(dataclasses.replace(CFG, n_experts=0)) == ()
    _, params = init_params(CFG, 0)
    assert "experts" in params["layers"][0]["mlp"] and "gate_proj" in params["layers"][1]["mlp"]


def test_the_model_reports_each_sparse_layer_s_routing_and_replays_it():
    graphdef, params = init_params(CFG, 0)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 64, (2, 9)), jnp.int32)
    mask = jnp.ones(tokens.shape, bool)
    h, unembed, routing = routed_score_hidden(graphdef, params, tokens, mask)
    assert routing.experts.shape == (2, 2, 9, 2) and routing.logits.shape == (2, 2, 9, 6)
    np.testing.assert_allclose(np.asarray(unembed(h)), np.asarray(forward(graphdef, params, tokens, mask)), atol=1e-6)
    h2, _, replayed = routed_score_hidden(graphdef, params, tokens, mask, routes=routing.experts, remat="full")
    np.testing.assert_array_equal(np.asarray(replayed.experts), np.asarray(routing.experts))
    np.testing.assert_allclose(np.asarray(h2), np.asarray(h), atol=1e-6)


def test_route_disagreement_counts_tokens_whose_expert_set_differs():
    recorded = jnp.asarray([[[[0, 1], [2, 3], [4, 5]]]])  # [L=1, B=1, T=3, k=2]
    current = jnp.asarray([[[[1, 0], [2, 4], [4, 5]]]])  # same set, a different set, same
    mask = jnp.ones((1, 3), bool)
    assert float(moe.route_disagreement(current, recorded, mask)) == pytest.approx(1 / 3)
    assert float(moe.route_disagreement(current, recorded, jnp.asarray([[True, False, True]]))) == 0.0


@pytest.mark.parametrize("override, key", [
    ({"experts_per_token": 7}, "model.experts_per_token"),
    ({"moe_dense_layers": [5]}, "model.moe_dense_layers"),
    ({"n_experts": -1}, "model.n_experts"),
])
def test_mismatched_expert_counts_are_config_errors(override, key):
    from jaxreplay.config import Config

    cfg = Config(model=dataclasses.replace(CFG, **override))
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg)


def test_a_qwen3_moe_config_json_routing_to_more_experts_than_it_has_is_refused():
    import transformers

    from jaxreplay.models.errors import HFModelError
    from jaxreplay.models.hf import model_config_from_hf

    hf = transformers.Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=8, moe_intermediate_size=8,
                                     num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])
    cfg = model_config_from_hf(hf)
    assert (cfg.n_experts, cfg.experts_per_token, cfg.moe_dense_layers, cfg.router_aux_loss_coef) == (4, 2, (1,), 0.0)
    hf.num_experts_per_tok = 6
    with pytest.raises(HFModelError, match="num_experts_per_tok=6 of num_experts=4 is not supported"):
        model_config_from_hf(hf)


@pytest.mark.slow
def test_the_demo_moe_config_trains_with_the_load_balancing_loss_in_its_loss(tmp_path):
    from test_train import TINY

    from jaxreplay.config import load_config
    from jaxreplay.train.driver import train
    from jaxreplay.train.metrics import read_metrics

    config = load_config(ROOT / "configs" / "demo_moe.yaml", [*TINY, "train.steps=3", "model.router_aux_loss_coef=0.5",
                                                              f"run.dir={tmp_path / 'run'}"])
    assert (config.model.n_experts, config.model.experts_per_token) == (8, 2)
    train(config, log=lambda _: None)
    records = read_metrics(config.run.dir)[1:]
    assert len(records) == 3
    for r in records:
        assert r["router_aux_loss"] > 0
        assert 0 <= r["router_disagreement"] <= 1  # the rows carried the sampler's routes through the table
        assert r["loss"] == pytest.approx(r["pg_loss"] + 0.5 * r["router_aux_loss"], rel=1e-4, abs=1e-5)


# A two-layer Qwen3-MoE-shaped policy on the demo's task, both layers sparse: rollouts from the real sampler.
MOE_POLICY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
              "model.d_ff=64", "model.qk_norm=true", "model.n_experts=6", "model.experts_per_token=2",
              "model.moe_d_ff=16", "task.max_digits=2"]


@pytest.fixture(scope="module")
def moe_rollouts():
    from jaxreplay.config import load_config
    from jaxreplay.rollout.rollouts import row_spec
    from jaxreplay.rollout.sampling import make_sampler
    from jaxreplay.tasks.registry import make_task

    config = load_config(None, MOE_POLICY)
    task = make_task(config.task)
    graphdef, params = init_params(config.model, 0)
    s = config.sampling
    sample = make_sampler(graphdef, config.model, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                          stop_ids=task.tokenizer.eos_ids, pad_id=task.tokenizer.pad_id, prefill_chunk_size=3)
    prompts, mask = task.encode_prompts(task.train_problems(0, 0, 8))
    r = jax.device_get(sample(params, prompts, mask, jax.random.PRNGKey(1)))
    assert row_spec(config, prompts.shape[1])["routes"] == ((r.tokens.shape[1], 2, 2), np.dtype(np.int16))
    return config, graphdef, params, r


def _batch(r, advantage: float = 1.0):
    from jaxreplay.rollout.rollouts import to_device_batch

    return to_device_batch({"tokens": r.tokens, "attention_mask": r.attention_mask, "completion_mask": r.completion_mask,
                            "logprobs": r.logprobs, "advantage": np.full(len(r.tokens), advantage, np.float32),
                            "routes": r.routes})


def _ran(r) -> np.ndarray:
    return np.asarray(r.routes[:, :, 0, 0]) >= 0  # [B, T]: the tokens the sampler ran through the model


def test_the_sampler_records_each_token_s_experts_and_the_learner_rescores_its_logprobs(moe_rollouts):
    from jaxreplay.rollout.sampling import policy_logprobs

    config, graphdef, params, r = moe_rollouts
    ran = _ran(r)
    mask = np.asarray(r.attention_mask)
    # every real token but each row's last one went through the model (prefilled in chunks of 3, then decoded)
    last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
    expected = mask.copy()
    expected[np.arange(len(mask)), last] = last < mask.shape[1] - 1  # a row that filled every column ran its last
    np.testing.assert_array_equal(ran[:, :-1], expected[:, :-1])
    h, unembed, routing = routed_score_hidden(graphdef, params, jnp.asarray(r.tokens), jnp.asarray(r.attention_mask))
    own = np.sort(np.moveaxis(np.asarray(routing.experts), 0, 2), axis=-1)  # [B, T, L, k]
    np.testing.assert_array_equal(own[ran], np.sort(np.asarray(r.routes), axis=-1)[ran])
    lp = policy_logprobs(unembed(h), jnp.asarray(r.tokens), temperature=config.sampling.temperature)
    completion = np.asarray(r.completion_mask)
    np.testing.assert_allclose(np.asarray(lp)[completion], np.asarray(r.logprobs)[completion], atol=1e-5)


def _moved_router(params, seed: int = 7):
    """A copy of `params` with every router kernel moved far enough that it routes many tokens elsewhere."""
    rng = np.random.default_rng(seed)

    def move(path, x):
        if "router" not in jax.tree_util.keystr(path):
            return jnp.array(x, copy=True)  # the update donates its params: the fixture's stay whole
        return x + jnp.asarray(rng.normal(size=x.shape), x.dtype)

    return jax.tree_util.tree_map_with_path(move, params)


@pytest.mark.parametrize("replay", [False, True])
def test_with_routing_replay_the_learner_routes_as_the_sampler_did(moe_rollouts, replay):
    """The router moves between sampling and learning: its own top k then differs from the recorded one on
    many tokens. With `train.routing_replay` the update's log-probs are those of the recorded routes;
    without, of the router's own."""
    from jaxreplay.config import load_config
    from jaxreplay.learn.learner import make_optimizer, make_train_step
    from jaxreplay.rollout.sampling import policy_logprobs

    _, graphdef, params, r = moe_rollouts
    config = load_config(None, [*MOE_POLICY, f"train.routing_replay={str(replay).lower()}"])
    moved = _moved_router(params)
    tokens, mask = jnp.asarray(r.tokens), jnp.asarray(r.attention_mask)
    recorded = jnp.moveaxis(jnp.asarray(r.routes), 2, 0)
    _, _, own = routed_score_hidden(graphdef, moved, tokens, mask)
    h, unembed, replayed = routed_score_hidden(graphdef, moved, tokens, mask, routes=recorded)
    ran = _ran(r)
    np.testing.assert_array_equal(np.moveaxis(np.asarray(replayed.experts), 0, 2)[ran], np.asarray(r.routes)[ran])
    differs = float(moe.route_disagreement(own.experts, recorded, jnp.asarray(ran)))
    assert differs > 0.2

    lp = np.asarray(policy_logprobs(unembed(h) if replay else forward(graphdef, moved, tokens, mask), tokens,
                                    temperature=config.sampling.temperature))
    completion = np.asarray(r.completion_mask)
    want = float(np.mean(np.exp(lp - np.asarray(r.logprobs))[completion]))
    optimizer = make_optimizer(config.train)
    _, _, m = make_train_step(graphdef, config, optimizer)(moved, optimizer.init(moved), _batch(r), None)
    assert float(m["ratio_mean"]) == pytest.approx(want, rel=1e-5)
    # the router's own top k on the update's activations (with replay, the replayed layers' outputs) against the record
    choice = jax.lax.top_k((replayed if replay else own).logits, 2)[1]
    assert float(m["router_disagreement"]) == pytest.approx(
        float(moe.route_disagreement(choice, recorded, jnp.asarray(ran))), rel=1e-4)


def test_the_continuous_engine_records_the_experts_of_every_token_it_runs_and_routing_replay_takes_them():
    """Multi-turn episodes of a mixture of experts on a pool too small for a step's groups (rows wait in
    prefix entries, then decode out of step), prompts and answers prefilled in chunks of 3: each row's
    routes are its tokens' experts under the learner's router on the same weights, at every real token but
    its last (no step ran it), the environment's tokens included; its behaviour log-probs are the learner's."""
    from jaxreplay.config import load_config
    from jaxreplay.learn.scoring import sequence_scores

    from test_multiturn import DEMO_MT, LONG_ANSWERS, TINY_MT, run_episodes

    moe_mt = [*LONG_ANSWERS, "model.n_layers=2", "model.n_experts=6", "model.experts_per_token=2",
              "model.moe_d_ff=16", "sampling.engine_slots=6", "sampling.prefill_chunk_size=3",
              "train.routing_replay=true"]
    validate(load_config(DEMO_MT, [*TINY_MT, *moe_mt]))
    stats = []
    config, task, graphdef, params, rows, _ = run_episodes(moe_mt, engine_stats=stats)
    (stats,) = stats
    assert stats.entry_groups > 0 and stats.answer_prefills > 0, "the placement and answer-prefill paths ran"
    routes, mask = rows["routes"], rows["attention_mask"]
    assert routes.shape == (*mask.shape, 2, 2) and routes.dtype == np.int16
    ran = routes[:, :, 0, 0] >= 0
    last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
    expected = mask.copy()
    expected[np.arange(len(mask)), last] = False
    np.testing.assert_array_equal(ran, expected)
    assert (ran & ~rows["completion_mask"])[:, task.prompt_len:].sum() > 20, "environment tokens routed too"
    tokens = jnp.asarray(rows["tokens"])
    h, unembed, own = routed_score_hidden(graphdef, params, tokens, jnp.asarray(mask))
    own = np.sort(np.moveaxis(np.asarray(own.experts), 0, 2), axis=-1)
    np.testing.assert_array_equal(own[ran], np.sort(routes, axis=-1)[ran])
    learner, _ = sequence_scores(h, tokens, unembed, temperature=config.sampling.temperature, with_entropy=False,
                                 live_vocab=task.tokenizer.vocab_size)
    completion = rows["completion_mask"]
    np.testing.assert_allclose(np.where(completion, rows["logprobs"], 0.0),
                               np.where(completion, np.asarray(learner), 0.0), atol=1e-5)

    # routing replay on these rows: with the routers moved, the update's ratios are those of the recorded routes
    from jaxreplay.learn.learner import make_optimizer, make_train_step
    from jaxreplay.rollout.rollouts import to_device_batch

    moved = _moved_router(params)
    h, unembed, _ = routed_score_hidden(graphdef, moved, tokens, jnp.asarray(mask),
                                        routes=jnp.moveaxis(jnp.asarray(routes), 2, 0))
    replayed, _ = sequence_scores(h, tokens, unembed, temperature=config.sampling.temperature, with_entropy=False,
                                  live_vocab=task.tokenizer.vocab_size)
    want = float(np.mean(np.exp(np.asarray(replayed) - rows["logprobs"])[completion]))
    optimizer = make_optimizer(config.train)
    step = make_train_step(graphdef, config, optimizer, live_vocab=task.tokenizer.vocab_size)
    _, _, m = step(moved, optimizer.init(moved), to_device_batch(rows), None)
    assert float(m["ratio_mean"]) == pytest.approx(want, rel=1e-5)
    assert float(m["router_disagreement"]) > 0.1, "the moved routers would have routed elsewhere"


def test_lora_adapts_attention_and_the_dense_mlps_and_freezes_the_experts(tmp_path):
    import json

    from flax import nnx

    from jaxreplay.config import LoraConfig
    from jaxreplay.models import lora
    from jaxreplay.models.hf import save_peft_adapters

    cfg = dataclasses.replace(CFG, lora=LoraConfig(targets=("q_proj", "gate_proj", "down_proj"), rank=4, alpha=8))
    _, params = init_params(cfg, 0)
    adapters, _ = lora.split_adapters(params)
    owners = {".".join(map(str, p[:-1])) for p, _ in nnx.to_flat_state(adapters)}
    assert owners == {"layers.0.attn.q_proj", "layers.1.attn.q_proj", "layers.2.attn.q_proj",
                      "layers.1.mlp.gate_proj", "layers.1.mlp.down_proj"}  # layer 1 is the dense one
    out = save_peft_adapters(tmp_path / "peft", cfg, params)
    assert json.loads((out / "adapter_config.json").read_text())["target_modules"] == ["down_proj", "gate_proj",
                                                                                     "q_proj"]
