"""Held-out evaluation: greedy accuracy during training; pass@1 and pass@k of a saved policy.
Multi-turn tasks: greedy success and pass@k over episodes (`EpisodeEvaluator`).

`evaluate` is the loop's cheap check. `pass_at_k_eval` is the paper's protocol
(`jaxreplay eval`): pass@1 from one sample per problem at temperature 0.1, top-p
0.95, and pass@k from n samples per problem at temperature 1.0 with the unbiased
estimator 1 - C(n-c, k) / C(n, k) (Chen et al., 2021). The two pass@1 values differ
(temperatures 0.1 and 1.0), so every result key names its temperature.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from flax import nnx

from jaxreplay import storage
from jaxreplay.config import Config
from jaxreplay.models import lora
from jaxreplay.rollout.sampling import completion_ids, make_sampler
from jaxreplay.tasks.base import Task, Tokenizer, score
from jaxreplay.train.guards import Preempted, describe, pending

EVAL_BATCH = 128  # rows per sampling call, fixed so evaluation compiles once

PASS1_TEMPERATURE, PASS1_TOP_P = 0.1, 0.95
PASSK_TEMPERATURE = 1.0
PASS1_KEY = f"pass@1_t{PASS1_TEMPERATURE}"  # eval.json keys: "pass@1_t0.1", "pass@k_t1.0" (k -> value)
PASSK_KEY = f"pass@k_t{PASSK_TEMPERATURE}"


TEST_KEY, VALIDATION_KEY = "eval/accuracy", "eval/validation_accuracy"


def evaluations(params, task: Task, greedy_sample_fn,
                stopping: Callable[[], Optional[int]] = lambda: None) -> dict[str, float]:
    """Greedy accuracy on the test split and, where the task has one, on the validation split:
    the loop's evaluation, recorded under TEST_KEY and VALIDATION_KEY."""
    out = {TEST_KEY: evaluate(params, task, greedy_sample_fn, stopping)}
    if task.validation_problems:
        out[VALIDATION_KEY] = evaluate(params, task, greedy_sample_fn, stopping, task.validation_problems)
    return out


def evaluate(params, task: Task, greedy_sample_fn, stopping: Callable[[], Optional[int]] = lambda: None,
             problems: Optional[Sequence[Any]] = None) -> float:
    """Fraction of `problems` (the test split unless given) answered exactly; the last batch is
    padded, not reshaped. `stopping` (guards.stop_poll) is asked before each batch: a stop signal
    ends the evaluation there with `Preempted`, since a long one would outlast a preemption notice."""
    problems = task.eval_problems if problems is None else problems
    correct = 0.0
    key = jax.random.PRNGKey(0)  # unused by greedy decoding, required by the signature
    for start in range(0, len(problems), EVAL_BATCH):
        if signum := stopping():
            raise Preempted(f"{describe(signum)} during an evaluation", signum)
        chunk = problems[start:start + EVAL_BATCH]
        padded = list(chunk) + [chunk[-1]] * (EVAL_BATCH - len(chunk))
        prompts, prompt_mask = task.encode_prompts(padded)
        rollout = jax.device_get(greedy_sample_fn(params, prompts, prompt_mask, key))
        rewards, _ = score(task, chunk, completion_ids(rollout)[:len(chunk)])
        correct += float(rewards.sum())
    return correct / len(problems)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k), computed stably."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def count_correct(params, task: Task, sample_fn, n: int, key: jax.Array, batch: int = EVAL_BATCH,
                  progress: Callable[[int], Any] = lambda samples: None) -> tuple[np.ndarray, int]:
    """(correct samples per eval problem [P], reward errors): n samples each, a problem's n
    samples always in one sampling call; `progress` hears how many samples each call scored."""
    if not 0 < n <= batch:
        raise ValueError(f"{n} samples per problem do not fit a sampling batch of {batch} rows (raise --batch)")
    problems = list(task.eval_problems)
    per_call = batch // n
    correct = np.zeros(len(problems), np.int64)
    errors = 0
    for call, start in enumerate(range(0, len(problems), per_call)):
        chunk = problems[start:start + per_call]
        padded = chunk + [chunk[-1]] * (per_call - len(chunk))
        prompts, prompt_mask = task.encode_prompts(padded)
        prompts, prompt_mask = np.repeat(prompts, n, axis=0), np.repeat(prompt_mask, n, axis=0)
        rollout = jax.device_get(sample_fn(params, prompts, prompt_mask, jax.random.fold_in(key, call)))
        rows = len(chunk) * n
        rewards, e = score(task, chunk, completion_ids(rollout)[:rows], n)
        correct[start:start + len(chunk)] = (rewards.reshape(len(chunk), n) == 1.0).sum(axis=1)
        errors += e
        progress(rows)
    return correct, errors


def pass_at_k_eval(params, task: Task, make_sampler_fn: Callable[..., Any], ks: Sequence[int], seed: int,
                   batch: int = EVAL_BATCH, progress: Callable[[int], Any] = lambda samples: None) -> dict[str, Any]:
    """pass@1 (one sample at temperature 0.1, top-p 0.95) and pass@k for every k in `ks`
    (max(ks) samples at temperature 1.0), under keys that name the temperature.
    `make_sampler_fn(temperature=, top_p=)` builds a sampler; `progress` as in `count_correct`."""
    key = jax.random.PRNGKey(seed)
    n = max(ks)
    pass1_correct, pass1_errors = count_correct(
        params, task, make_sampler_fn(temperature=PASS1_TEMPERATURE, top_p=PASS1_TOP_P), 1,
        jax.random.fold_in(key, 1), batch, progress)
    correct, errors = count_correct(params, task, make_sampler_fn(temperature=PASSK_TEMPERATURE, top_p=1.0), n,
                                    jax.random.fold_in(key, 2), batch, progress)
    return {
        "problems": len(task.eval_problems),
        PASS1_KEY: float(pass1_correct.mean()),
        f"{PASS1_KEY}_settings": {"temperature": PASS1_TEMPERATURE, "top_p": PASS1_TOP_P, "samples_per_problem": 1},
        **pass_at_k_scores(correct, n, ks),
        "reward/errors": pass1_errors + errors,
    }


def pass_at_k_scores(correct: np.ndarray, n: int, ks: Sequence[int]) -> dict[str, Any]:
    """eval.json's pass@k keys from each problem's correct samples out of n (temperature 1.0)."""
    return {
        PASSK_KEY: {str(k): float(np.mean([pass_at_k(n, int(c), k) for c in correct])) for k in sorted(set(ks))},
        f"{PASSK_KEY}_settings": {"temperature": PASSK_TEMPERATURE, "top_p": 1.0, "samples_per_problem": n},
        "correct_per_problem": correct.tolist(),
    }


def load_policy(config: Config, *, checkpoint: Optional[str] = None, hf: Optional[str] = None,
                step: Optional[int] = None):
    """(model config, graphdef, params, tokenizer or None, where they came from) of a run's
    checkpoint (a run dir or its checkpoints/) or of a Hugging Face directory."""
    from jaxreplay.models.hf import load_hf_model, read_model_config
    from jaxreplay.models.tokenizer import load_tokenizer
    from jaxreplay.models.transformer import Transformer, split

    m = config.model
    own_tokenizer = config.task.name == "arithmetic"  # the embedded task always uses its CharTokenizer
    if (checkpoint is None) == (hf is None):
        raise ValueError("give exactly one of --checkpoint DIR and --hf PATH")
    if hf is not None:
        cfg, graphdef, params = load_hf_model(hf, param_dtype=m.param_dtype, compute_dtype=m.compute_dtype,
                                              max_seq_len=m.max_seq_len)
        tokenizer = None if own_tokenizer else load_tokenizer(hf, vocab_size=cfg.vocab_size)
        return cfg, graphdef, params, tokenizer, {"hf": str(hf)}

    from jaxreplay.train.checkpoint import restore_policy_params

    cfg = m if m.hf_path is None else dataclasses.replace(read_model_config(
        m.hf_path, param_dtype=m.param_dtype, compute_dtype=m.compute_dtype, max_seq_len=m.max_seq_len), lora=m.lora,
        moe_dispatch=m.moe_dispatch)
    graphdef, abstract = split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0))))
    directory = str(checkpoint)  # a run dir or its checkpoints/, on a disk or in a bucket
    if storage.isdir(storage.join(directory, "checkpoints")):
        directory = storage.join(directory, "checkpoints")
    if lora.enabled(cfg):  # the checkpoint holds the adapters; the base is read from where it came from
        params, step = _lora_policy(config, cfg, directory, abstract, step)
    else:
        params, step = restore_policy_params(directory, abstract, step)
    tokenizer = None if m.hf_path is None or own_tokenizer else load_tokenizer(m.hf_path, vocab_size=cfg.vocab_size)
    return cfg, graphdef, params, tokenizer, {"checkpoint": str(directory), "step": step}


def _lora_policy(config: Config, cfg, directory: str, abstract, step: Optional[int]):
    """(params, step) of a LoRA checkpoint: its adapters on the base they were trained on (the HF
    weights, or the warm start: from its cache, or recomputed, which gives the same weights), which
    must match the checksum the checkpoint recorded (`checkpoint.OtherBase` otherwise)."""
    from jaxreplay.models.hf import load_hf_model
    from jaxreplay.models.transformer import init_params
    from jaxreplay.tasks.registry import make_task
    from jaxreplay.train.checkpoint import base_digest, read_meta, restore_policy_params, restored_params
    from jaxreplay.train.warmstart import warm_start

    adapters, step = restore_policy_params(directory, lora.split_adapters(abstract)[0], step)
    base_cfg = lora.base_config(config)
    m = base_cfg.model
    if m.hf_path:
        _, _, base = load_hf_model(m.hf_path, param_dtype=m.param_dtype, compute_dtype=m.compute_dtype,
                                   max_seq_len=m.max_seq_len)
    else:
        graphdef, base = init_params(m, config.run.seed)
        base, _ = warm_start(graphdef, base, make_task(base_cfg.task), base_cfg, log=lambda _: None)
    params = lora.join(jax.tree.map(jax.numpy.zeros_like, adapters), base)
    saved = read_meta(directory, step).get("base_digest", "")
    return restored_params(params, adapters, saved, base_digest(params), storage.join(directory, str(step))), step


def eval_sampler_factory(graphdef, cfg, max_new_tokens: int, tokenizer: Tokenizer, *,
                         kv_cache_dtype: Optional[str] = None, prefill_chunk_size: int = 0) -> Callable[..., Any]:
    """`make_sampler_fn(temperature=, top_p=)` for `pass_at_k_eval`: samplers that stop on every
    one of the tokenizer's stop ids, as the training rollouts do, with the run's cache settings."""

    def make_sampler_fn(temperature: float, top_p: float):
        return make_sampler(graphdef, cfg, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                            stop_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id, kv_cache_dtype=kv_cache_dtype,
                            prefill_chunk_size=prefill_chunk_size, live_vocab=tokenizer.vocab_size)

    return make_sampler_fn


def run_eval(config: Config, *, checkpoint: Optional[str] = None, hf: Optional[str] = None,
             step: Optional[int] = None, ks: Sequence[int] = (1,), out: Optional[str] = None,
             batch: int = EVAL_BATCH) -> dict[str, Any]:
    """`jaxreplay eval`: loads the policy, samples the task's eval split (its training split is
    never read), writes the results as JSON; a progress bar unless run.progress_bar is off."""
    from tqdm import tqdm

    from jaxreplay.tasks.registry import make_task

    start = time.perf_counter()
    cfg, graphdef, params, tokenizer, source = load_policy(config, checkpoint=checkpoint, hf=hf, step=step)
    task = make_task(config.task, tokenizer, train=False)
    s = config.sampling
    if task.prompt_len + s.max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"prompts of {task.prompt_len} tokens plus sampling.max_new_tokens={s.max_new_tokens} "
                         f"exceed model.max_seq_len={cfg.max_seq_len}")

    if config.environment.name:  # multi-turn: greedy episodes through the engine, as the training loop evaluates
        one = dataclasses.replace(config, model=cfg)
        scores = EpisodeEvaluator(one, task, graphdef, params, live_vocab=task.tokenizer.vocab_size)(params, pending)
        results = {"task": config.task.name, "split": "test", "environment": config.environment.name, **source,
                   "episodes": len(task.eval_problems), "success_greedy": scores[TEST_KEY],
                   "turns_greedy": scores[TURNS_KEY],
                   **episode_pass_at_k(one, task, graphdef, params, ks, config.run.seed, pending),
                   "max_new_tokens": s.max_new_tokens, "seconds": round(time.perf_counter() - start, 1)}
        if out is not None:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(results, indent=2) + "\n")
        return results
    sampler = eval_sampler_factory(graphdef, cfg, s.max_new_tokens, task.tokenizer, kv_cache_dtype=s.kv_cache_dtype,
                                   prefill_chunk_size=s.prefill_chunk_size)
    samples = len(task.eval_problems) * (1 + max(ks))

    def progress(scored: int) -> None:  # after each sampling call: a stop signal ends it, nothing written
        bar.update(scored)
        if signum := pending():
            raise Preempted(f"{describe(signum)} during the evaluation: nothing written", signum)

    with tqdm(total=samples, desc="eval", unit="sample", disable=not config.run.progress_bar,
              dynamic_ncols=True) as bar:
        scores = pass_at_k_eval(params, task, sampler, ks, config.run.seed, batch, progress=progress)
    results = {
        "task": config.task.name,
        "split": {"arithmetic": "held-out", "reasoning_gym": "test"}.get(config.task.name, config.task.eval_split),
        **source,
        **scores,
        "max_new_tokens": s.max_new_tokens,
        "seconds": round(time.perf_counter() - start, 1),
    }
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=2) + "\n")
    return results


TURNS_KEY = "eval/turns"  # multi-turn: mean model turns per evaluation episode


class EpisodeEvaluator:
    """Evaluation of multi-turn episodes through the same engine and environments the rollouts
    use: `samples` episodes per held-out item (each reset with seed = the item's index in its
    split), success = reward 1. Greedy, one episode an item, unless a `temperature` is given
    (pass@k). Its engine (group size `samples`) is built once and takes the weights it is given."""

    def __init__(self, config: Config, task: Task, graphdef, params, *, live_vocab: int, mesh=None,
                 slots: Optional[int] = None, samples: int = 1, temperature: Optional[float] = None):
        """`slots`: episodes in flight (default `environment.eval_slots`, at least `samples`); thread workers
        are at least as many, so that steps which take time run side by side (process workers stay as
        configured)."""
        from jaxreplay.rollout.actor import make_episode_runner
        from jaxreplay.rollout.engine import JaxEngine

        if temperature is None and samples != 1:
            raise ValueError(f"greedy evaluation plays one episode an item, not {samples}: give a temperature")
        e = config.environment
        slots = max(slots or e.eval_slots, samples)
        workers = max(e.workers, slots) if e.workers and not e.processes else e.workers
        one = dataclasses.replace(config, train=dataclasses.replace(config.train, group_size=samples),
                                  environment=dataclasses.replace(e, workers=workers))
        self.task, self.runner, self.samples = task, make_episode_runner(one, task), samples
        s, tok = config.sampling, task.tokenizer
        self.engine = JaxEngine(graphdef, config.model, params, slots=slots, group_size=samples,
                                prompt_len=task.prompt_len, max_new_tokens=s.max_new_tokens,
                                chunk_steps=s.engine_chunk_steps, greedy=temperature is None,
                                temperature=temperature or 1.0, stop_ids=tok.eos_ids, pad_id=tok.pad_id,
                                kv_cache_dtype=s.kv_cache_dtype, prefill_chunk_size=s.prefill_chunk_size,
                                live_vocab=live_vocab, mesh=mesh, turns=self.runner)

    def evaluations(self, params, stopping: Callable[[], Optional[int]] = lambda: None) -> dict[str, float]:
        """Success and turns on the test split and, where the task has one, success on the
        validation split: the loop's evaluation, keyed as `evaluations` keys single-turn runs'
        (VALIDATION_KEY is what stage 1 chooses learning rates on)."""
        out = self(params, stopping)
        if self.task.validation_problems:
            out[VALIDATION_KEY] = self(params, stopping, self.task.validation_problems)[TEST_KEY]
        return out

    def __call__(self, params, stopping: Callable[[], Optional[int]] = lambda: None,
                 problems: Optional[Sequence[Any]] = None) -> dict[str, float]:
        """Success (under TEST_KEY: the mean over items of each item's share of successful
        episodes) and mean turns, over `problems` (the test split unless given)."""
        successes, turns = self.success_counts(params, stopping, problems)
        return {TEST_KEY: float((successes / self.samples).mean()), TURNS_KEY: float(turns.mean())}

    def success_counts(self, params, stopping: Callable[[], Optional[int]] = lambda: None,
                       problems: Optional[Sequence[Any]] = None, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(successful episodes of each item's `samples` [P], each item's mean turns [P]); an item's
        episodes are one group, sampled with keys from `seed` and the item's index."""
        from jaxreplay.rollout.engine import PromptGroup

        problems = self.task.eval_problems if problems is None else problems
        self.engine.update_weights(params, 0)
        key = jax.random.key(seed)  # greedy: never read
        groups = []
        for i, item in enumerate(problems):
            tokens, mask = self.runner.open(i, item, i)
            groups.append(PromptGroup(tag=i, tokens=tokens, mask=mask, key=jax.random.fold_in(key, i)))
        self.engine.submit(groups)
        successes, turns = np.zeros(len(problems), np.int64), np.zeros(len(problems))
        while self.engine.pending():
            if signum := stopping():
                raise Preempted(f"{describe(signum)} during an evaluation", signum)
            self.engine.step()
            for group in self.engine.collect():
                result = self.runner.result(group.tag)
                successes[group.tag] = int((np.asarray(result["reward"]) == 1.0).sum())
                turns[group.tag] = float(np.mean(result["turns"]))
        return successes, turns


def episode_pass_at_k(config: Config, task: Task, graphdef, params, ks: Sequence[int], seed: int,
                      stopping: Callable[[], Optional[int]] = lambda: None) -> dict[str, Any]:
    """Multi-turn pass@k for every k in `ks`: max(ks) episodes per test item at temperature 1.0
    (top-p 1), the unbiased estimator over each item's successes, as `pass_at_k_eval` for one turn."""
    n = max(ks)
    evaluator = EpisodeEvaluator(config, task, graphdef, params, live_vocab=task.tokenizer.vocab_size,
                                 samples=n, temperature=PASSK_TEMPERATURE)
    successes, _ = evaluator.success_counts(params, stopping, seed=seed)
    return pass_at_k_scores(successes, n, ks)
