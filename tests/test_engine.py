"""The rollout engine keeps the static sampler's contract: same tokens when greedy, the model's
distribution when sampling, the learner's log-probs, one prefill per prompt group, and exact
behaviour log-probs when the weights change between chunks."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxreplay.config import ModelConfig
from jaxreplay.learn.scoring import sequence_scores
from jaxreplay.models.transformer import apply, init_cache, init_params, score_hidden
from jaxreplay.rollout.engine import JaxEngine, PromptGroup, pool_cache_bytes
from jaxreplay.rollout.sampling import filter_logits, make_sampler

CFG = ModelConfig(vocab_size=8, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                  max_seq_len=20, tie_embeddings=False, attention_bias=True, qk_norm=True)
PAD, EOS = 0, 1
P, N = 6, 10
LENGTHS = [6, 4, 1, 3, 6, 2, 5, 6]


def params_for(seed, scale=0.3):
    """Init plus noise on every param, so the distributions are far from uniform."""
    graphdef, params = init_params(CFG, 0)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return graphdef, jax.tree.unflatten(treedef, [x + scale * jax.random.normal(k, x.shape)
                                                  for x, k in zip(leaves, keys)])


GRAPHDEF, PARAMS = params_for(0)


def prompts(seed, lengths):
    """Left-padded prompts [len(lengths), P] of real tokens in [2, V)."""
    tokens = np.asarray(jax.random.randint(jax.random.key(seed), (len(lengths), P), 2, CFG.vocab_size), np.int32)
    mask = np.arange(P)[None, :] >= (P - np.asarray(lengths))[:, None]
    return np.where(mask, tokens, PAD).astype(np.int32), mask


PROMPT, PROMPT_MASK = prompts(1, LENGTHS)


def groups(tokens, mask, seed=0, first_tag=0):
    return [PromptGroup(first_tag + i, tokens[i], mask[i], jax.random.fold_in(jax.random.key(seed), first_tag + i))
            for i in range(len(tokens))]


def drain(engine, schedule=None):
    """Steps until every submitted group is collected; `schedule(chunk)` may update weights
    before each chunk. Completed groups by tag, and the order they completed in."""
    out, order, chunk = {}, [], 0
    while engine.pending():
        if schedule:
            schedule(engine, chunk)
        engine.step()
        chunk += 1
        for c in engine.collect():
            out[c.tag] = c
            order.append(c.tag)
    return out, order


def stacked(done, field):
    return np.concatenate([getattr(done[tag].rollout, field) for tag in sorted(done)])


SAMPLED = dict(temperature=0.7, stop_ids=(EOS,), pad_id=PAD)


def sampled_engine(params=PARAMS, **kw):
    """Fewer slots (8) than rows (32): groups start as others finish."""
    settings = dict(slots=8, group_size=4, prompt_len=P, max_new_tokens=N, chunk_steps=3, **SAMPLED)
    return JaxEngine(GRAPHDEF, CFG, params, **{**settings, **kw})


def test_greedy_engine_output_equals_the_static_samplers_with_rows_stopping_at_different_lengths():
    g, stops = 2, (3, 7)
    static = make_sampler(GRAPHDEF, CFG, max_new_tokens=N, greedy=True, stop_ids=stops, pad_id=PAD)
    want = jax.tree.map(np.asarray, static(PARAMS, np.repeat(PROMPT, g, 0), np.repeat(PROMPT_MASK, g, 0),
                                           jax.random.key(0)))
    lengths = want.completion_mask.sum(axis=1)
    assert len(set(lengths.tolist())) >= 3, f"the fixture should stop rows at different lengths: {lengths}"
    engine = JaxEngine(GRAPHDEF, CFG, PARAMS, slots=6, group_size=g, prompt_len=P, max_new_tokens=N, chunk_steps=3,
                       greedy=True, stop_ids=stops, pad_id=PAD)
    engine.submit(groups(PROMPT, PROMPT_MASK))
    done, _ = drain(engine)
    assert engine.stats.narrow_chunks > 0, "the drain should run chunks on the live slots only"
    for field in ("tokens", "attention_mask", "completion_mask"):
        np.testing.assert_array_equal(stacked(done, field), getattr(want, field), err_msg=field)
    np.testing.assert_allclose(stacked(done, "logprobs"), want.logprobs, atol=1e-5)


def test_sampled_first_two_tokens_follow_the_models_distribution_within_5_sigma():
    """4096 completions of one prompt: each of the V^2 two-token beginnings (the rare ones pooled)
    is drawn with its probability under the model (the prefill's logits for the first, a decode step's for the
    second), within 5 sigma, and its reported log-prob is exactly log p."""
    g, groups_n, n_new = 8, 512, 2
    prompt, mask = PROMPT[:1], PROMPT_MASK[:1]
    engine = JaxEngine(GRAPHDEF, CFG, PARAMS, slots=64, group_size=g, prompt_len=P, max_new_tokens=n_new,
                       chunk_steps=1, temperature=1.0, stop_ids=(), pad_id=PAD)
    engine.submit(groups(np.repeat(prompt, groups_n, 0), np.repeat(mask, groups_n, 0)))
    done, _ = drain(engine)
    tokens, logprobs = stacked(done, "tokens")[:, P:], stacked(done, "logprobs")[:, P:]
    assert tokens.shape == (g * groups_n, n_new)

    v = CFG.vocab_size
    first = jax.nn.log_softmax(apply(GRAPHDEF, PARAMS, prompt, np.maximum(np.cumsum(mask, 1) - 1, 0), mask)[0][0, -1])
    seqs = np.concatenate([np.repeat(prompt, v, 0), np.arange(v, dtype=np.int32)[:, None]], axis=1)
    seq_mask = np.concatenate([np.repeat(mask, v, 0), np.ones((v, 1), bool)], axis=1)
    second = jax.nn.log_softmax(apply(GRAPHDEF, PARAMS, seqs, np.maximum(np.cumsum(seq_mask, 1) - 1, 0),
                                      seq_mask)[0][:, -1])
    joint = np.exp(np.asarray(first)[:, None] + np.asarray(second))  # [V, V]
    counts = np.zeros((v, v))
    np.add.at(counts, (tokens[:, 0], tokens[:, 1]), 1)
    n = len(tokens)
    common = n * joint >= 5  # the rest pooled into one bin: 5 sigma means nothing at 0.01 expected draws
    counts, probs = np.append(counts[common], counts[~common].sum()), np.append(joint[common], joint[~common].sum())
    assert common.sum() >= 12
    sigma = np.sqrt(n * probs * (1 - probs))
    assert (np.abs(counts - n * probs) <= 5 * sigma).all(), (counts, n * probs)
    np.testing.assert_allclose(logprobs[:, 0], np.asarray(first)[tokens[:, 0]], atol=1e-5)
    np.testing.assert_allclose(logprobs[:, 1], np.asarray(second)[tokens[:, 0], tokens[:, 1]], atol=1e-5)


@functools.lru_cache(maxsize=None)
def one_version_run():
    engine = sampled_engine()
    engine.submit(groups(np.tile(PROMPT, (4, 1)), np.tile(PROMPT_MASK, (4, 1))))
    return engine, *drain(engine)


def test_engine_logprobs_equal_the_learners_under_one_weight_version():
    engine, done, _ = one_version_run()
    tokens, attention = stacked(done, "tokens"), stacked(done, "attention_mask")
    completion, logprobs = stacked(done, "completion_mask"), stacked(done, "logprobs")
    assert 0 < completion.sum(axis=1).min() < N == completion.sum(axis=1).max(), "rows of several lengths"
    h, unembed = score_hidden(GRAPHDEF, PARAMS, jnp.asarray(tokens), jnp.asarray(attention))
    learner, _ = sequence_scores(h, jnp.asarray(tokens), unembed, temperature=0.7, with_entropy=False)
    np.testing.assert_allclose(logprobs, np.where(completion, np.asarray(learner), 0.0), atol=1e-5)
    assert all((c.token_versions[c.rollout.completion_mask[:, P:]] == 0).all() for c in done.values())


def test_a_prompt_is_prefilled_once_per_group_and_its_rows_draw_apart():
    engine, done, _ = one_version_run()
    assert engine.stats.prefill_rows == len(done) == 32 and sum(len(c.rollout.tokens) for c in done.values()) == 128
    distinct = [len({row.tobytes() for row in c.rollout.tokens}) for c in done.values()]
    assert max(distinct) > 1, "a group's rows share the prompt, not the draws"
    assert engine.pool.cache.k[0].nbytes * 2 * CFG.n_layers == pool_cache_bytes(CFG, 8, P, N)


def test_the_engines_shortcuts_change_no_row():
    """Whole groups prefilled straight into their slots, narrow chunks while the pool drains,
    one cache column per step for rows in step, and long chunks when nothing waits: with all four
    off, every group goes through a prefix entry and every chunk runs on the whole pool, and the
    rows are the same."""
    engine, done, _ = one_version_run()
    plain = sampled_engine()
    plain.start_whole_groups = plain.narrow_drain = plain.lockstep_writes = plain.long_drain_chunks = False
    plain.submit(groups(np.tile(PROMPT, (4, 1)), np.tile(PROMPT_MASK, (4, 1))))
    plain_done, _ = drain(plain)
    for field in ("tokens", "attention_mask", "completion_mask"):
        np.testing.assert_array_equal(stacked(done, field), stacked(plain_done, field), err_msg=field)
    np.testing.assert_allclose(stacked(done, "logprobs"), stacked(plain_done, "logprobs"), atol=1e-5)
    assert 0 < engine.stats.entry_groups < len(done) == plain.stats.entry_groups, "both ways of starting a group"
    assert engine.stats.narrow_chunks > 0 == plain.stats.narrow_chunks
    assert engine.stats.prefill_rows == plain.stats.prefill_rows == len(done)


@functools.lru_cache(maxsize=None)
def weights(version):
    return params_for(version)[1] if version else PARAMS


def in_flight(engine, chunk):
    """New weights before every second chunk: versions 0, 0, 1, 1, 2, 2, ..."""
    if chunk % 2 == 0 and chunk:
        engine.update_weights(weights(chunk // 2), chunk // 2)


def test_rows_whose_weights_change_mid_sequence_record_the_log_prob_of_the_distribution_they_drew_from():
    """An instrumented re-run, one row at a time with the model's own KV cache: the prompt's K/V
    under the version of the first token, each later token's input K/V and logits under the
    version that drew it. Each recorded log-prob is that of the drawn token there."""
    engine = sampled_engine()
    engine.submit(groups(np.tile(PROMPT, (2, 1)), np.tile(PROMPT_MASK, (2, 1)), seed=3))
    done, _ = drain(engine, in_flight)
    mixed = [(c, r) for c in done.values() for r in range(4) if c.first_version[r] != c.last_version[r]]
    assert len(mixed) >= 4, "the schedule should change weights under some rows"
    step = jax.jit(lambda params, tok, pos, mask, cache, index: apply(GRAPHDEF, params, tok, pos, mask, cache, index))
    final_params = weights(int(max(c.last_version.max() for c in done.values())))
    differs = 0
    for c, r in mixed:
        tokens, mask = c.rollout.tokens[r], c.rollout.attention_mask[r]
        n = int(c.rollout.completion_mask[r].sum())
        seen = weights(int(c.token_versions[r, 0]))
        cache = init_cache(CFG, 1, P + N)
        logits, cache = step(seen, tokens[None, :P], np.maximum(np.cumsum(mask[:P]) - 1, 0)[None], mask[None], cache, 0)
        want = [jax.nn.log_softmax(filter_logits(logits[0, -1], temperature=0.7))[tokens[P]]]
        for t in range(1, n):
            params = weights(int(c.token_versions[r, t]))
            pos = np.array([[int(mask[:P].sum()) + t - 1]])
            logits, cache = step(params, tokens[None, P + t - 1:P + t], pos, mask[None], cache, P + t - 1)
            want.append(jax.nn.log_softmax(filter_logits(logits[0, -1], temperature=0.7))[tokens[P + t]])
        np.testing.assert_allclose(c.rollout.logprobs[r, P:P + n], np.asarray(want), rtol=1e-5, atol=1e-5)
        h, unembed = score_hidden(GRAPHDEF, final_params, jnp.asarray(tokens[None]), jnp.asarray(mask[None]))
        one_version, _ = sequence_scores(h, jnp.asarray(tokens[None]), unembed, temperature=0.7, with_entropy=False)
        differs += not np.allclose(np.asarray(one_version)[0, P:P + n], want, atol=1e-3)
    assert differs, "no single version's forward pass reproduces such rows"


def test_the_same_seed_gives_the_same_run():
    runs = []
    for _ in range(2):
        engine = sampled_engine()
        engine.submit(groups(np.tile(PROMPT, (2, 1)), np.tile(PROMPT_MASK, (2, 1)), seed=3))
        runs.append(drain(engine, in_flight))
    (a, order_a), (b, order_b) = runs
    assert order_a == order_b
    for tag in a:
        for field in ("tokens", "attention_mask", "logprobs"):
            np.testing.assert_array_equal(getattr(a[tag].rollout, field), getattr(b[tag].rollout, field))
        np.testing.assert_array_equal(a[tag].token_versions, b[tag].token_versions)


def test_padded_vocabulary_ids_are_never_drawn_greedy_or_sampled():
    """ids from `live_vocab` on (an embedding padded past the tokenizer) have probability 0, as in
    the static sampler; with nearly flat logits about 3/8 of the draws would be such ids."""
    live = 5
    graphdef, flat = params_for(0)
    flat["lm_head"]["kernel"][...] = flat["lm_head"]["kernel"][...] * 0.01
    tokens, mask = np.tile(PROMPT, (4, 1)), np.tile(PROMPT_MASK, (4, 1))
    drawn = {}
    for greedy in (False, True):
        for lv in (0, live):
            engine = JaxEngine(graphdef, CFG, flat, slots=8, group_size=4, prompt_len=P, max_new_tokens=N,
                               chunk_steps=3, greedy=greedy, temperature=1.0, stop_ids=(), pad_id=PAD, live_vocab=lv)
            engine.submit(groups(tokens, mask))
            done, _ = drain(engine)
            drawn[greedy, lv] = stacked(done, "tokens")[:, P:]
    for greedy in (False, True):
        assert (drawn[greedy, 0] >= live).any(), "the fixture should draw padded ids without live_vocab"
        assert (drawn[greedy, live] < live).all(), f"greedy={greedy}: a padded id was drawn"


def test_copying_stopped_rows_out_compiles_one_program_per_power_of_two_not_per_count():
    """However many rows stop in a chunk, they leave the pool through one of log2(S) + 1 gather
    programs: one program per count would be compiled mid-run, again whenever a new count comes."""
    slots, lowered = 16, []
    record = logging.Handler()
    record.emit = lambda r: lowered.append(r.getMessage())
    engine = JaxEngine(GRAPHDEF, CFG, params_for(3, scale=1.0)[1], slots=slots, group_size=1, prompt_len=P,
                       max_new_tokens=N - 1, chunk_steps=1, **SAMPLED)  # a pool shape no other test lowers
    tokens, mask = prompts(4, [1 + i % P for i in range(64)])
    engine.submit(groups(tokens, mask, seed=5))
    logging.getLogger("jax").addHandler(record)
    try:
        with jax.log_compiles():
            done, _ = drain(engine)
    finally:
        logging.getLogger("jax").removeHandler(record)
    assert len(done) == 64
    gathers = [m for m in lowered if "MLIR module conversion jit(_gather)" in m]
    assert 1 <= len(gathers) <= slots.bit_length(), gathers
