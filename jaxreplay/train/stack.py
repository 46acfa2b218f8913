"""The stack a run trains: policy, optimizer, train step, samplers, actor, evaluation.

One builder for every placement (placement.py says where each part lives): the policy
comes from released HF weights, or a fresh init and the supervised warm start; the
learner's parts live on the learner mesh, the samplers on the actor mesh.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

import optax

from jaxreplay.config import Config
from jaxreplay.learn.learner import TrainStep, make_optimizer, make_train_step
from jaxreplay.learn.trainable import initial_reference
from jaxreplay.models import sharding
from jaxreplay.models.hf import load_hf_model, read_model_config
from jaxreplay.models.tokenizer import load_tokenizer
from jaxreplay.models.lora import base_config
from jaxreplay.models.transformer import abstract_params, init_params, with_adapters
from jaxreplay.rollout.actor import Actor, StreamingActor, make_streaming_actor
from jaxreplay.rollout.rollouts import row_spec
from jaxreplay.rollout.sampling import make_run_samplers
from jaxreplay.rollout.weights import weight_sync
from jaxreplay.tasks.agent_loop import AgentLoop, is_agent_loop
from jaxreplay.tasks.base import Task
from jaxreplay.tasks.registry import make_task
from jaxreplay.train import distributed
from jaxreplay.train.eval import EpisodeEvaluator, evaluations
from jaxreplay.train.guards import stop_poll
from jaxreplay.train.placement import Placement
from jaxreplay.train.warmstart import warm_start


@dataclasses.dataclass
class Stack:
    config: Config  # as the run uses it: an HF model's architecture in `model`
    task: Task
    spec: dict  # the rollout row (rollouts.row_spec)
    graphdef: Any
    params: Any  # on the learner mesh
    ref_params: Optional[Any]  # the KL reference, when train.kl_coef > 0
    optimizer: optax.GradientTransformation
    opt_state: Any
    train_step: TrainStep
    actor: Actor  # the static sampler's (calibration uses it; also the rollouts with sampling.engine static)
    evaluate: Callable[[Any], dict[str, float]]  # params on the actor mesh -> eval/accuracy (and validation's)
    to_actor: Callable[[Any], Any]  # learner params -> the actor's copy (identity when they share a mesh)
    stream: Optional[StreamingActor] = None  # sampling.engine continuous: the rollouts stream through it


def resolved_model(config: Config) -> Config:
    """`config` with an HF model's architecture read from its config.json (no weights read), so
    the run's records hold the model it trains."""
    m = config.model
    if not m.hf_path:
        return config
    model = read_model_config(m.hf_path, param_dtype=m.param_dtype, compute_dtype=m.compute_dtype,
                              max_seq_len=m.max_seq_len)
    return dataclasses.replace(config, model=dataclasses.replace(model, lora=m.lora, moe_dispatch=m.moe_dispatch))


def build_stack(config: Config, placement: Placement, log: Callable[[str], None]) -> Stack:
    """Every part of the run, fresh: params from the policy source, a new optimizer state."""
    c = resolved_model(config)
    learner_mesh = placement.learner_mesh
    task, graphdef, params = _policy(c, placement, log)
    params = sharding.shard_params(params, learner_mesh)
    tok = task.tokenizer
    live = tok.vocab_size  # the tokenizer's ids: an embedding padded past them is never sampled
    sample_fn, greedy_fn = make_run_samplers(graphdef, c, stop_ids=tok.eos_ids, pad_id=tok.pad_id,
                                             mesh=placement.actor_mesh, live_vocab=live)
    optimizer = make_optimizer(c.train)
    shard = (placement.process_id, placement.processes)
    greedy = placement.eval_sampler(greedy_fn)
    stopping = _stop_poll(c, placement)
    return Stack(
        config=c, task=task, spec=row_spec(c, task.prompt_len), graphdef=graphdef, params=params,
        ref_params=initial_reference(params, c.train.kl_coef),
        optimizer=optimizer, opt_state=sharding.shard_params(optimizer.init(params), learner_mesh),
        train_step=make_train_step(graphdef, c, optimizer, learner_mesh, live_vocab=live),
        actor=Actor(c, task, placement.rollout_sampler(sample_fn), shard=shard),
        evaluate=_episode_evaluation(c, task, graphdef, params, live, placement, stopping)
        if c.environment.name and not is_agent_loop(c.environment.name)
        else lambda p: evaluations(p, task, greedy, stopping),
        to_actor=_to_mesh(c, placement) if placement.actor_mesh is not learner_mesh else (lambda p: p),
        stream=make_streaming_actor(graphdef, c, task, params, stop_ids=tok.eos_ids, pad_id=tok.pad_id, shard=shard,
                                    live_vocab=live, mesh=placement.engine_mesh,
                                    episodes=_agent_loop(c, task) if is_agent_loop(c.environment.name) else None)
        if c.sampling.engine == "continuous" else None,
    )


def _agent_loop(c: Config, task: Task):
    """An outside agent loop's episodes, and the endpoint its harnesses call (serve/episodes.py):
    the run's own engine answers, with the run's sampling settings."""
    from jaxreplay.rollout.outside import OutsideEpisodes
    from jaxreplay.serve.episodes import serve_episodes
    from jaxreplay.serve.run import bearer_token
    from jaxreplay.serve.worker import Draw

    e, s = c.environment, c.sampling
    loop = AgentLoop(**dict(e.options))
    episodes = OutsideEpisodes(loop.bound(), group_size=c.train.group_size, prompt_len=task.prompt_len,
                               max_turns=e.max_turns, timeout=e.step_timeout_s, pad_id=task.tokenizer.pad_id,
                               lockstep=loop.lockstep)
    serve_episodes(episodes, task.tokenizer, prompt_len=task.prompt_len, max_new_tokens=s.max_new_tokens,
                   draw=Draw.of(s.temperature, s.top_k, s.top_p), host=loop.host, port=loop.port,
                   model_id=c.model.hf_path or "jaxreplay", call_format=loop.call_format,
                   token=bearer_token(loop.host))
    return episodes


def _episode_evaluation(c: Config, task: Task, graphdef, params, live: int, placement: Placement, stopping):
    """Multi-turn runs evaluate episodes through the engine (built at the first evaluation).
    Multi-host, each process plays every episode on its own devices, as its streaming actor
    does: the weights are copied whole onto them first (a collective; all evaluate together)."""
    evaluator = []

    def evaluate(p):
        if placement.kind == "multihost":
            p = sharding.to_process_local(p, placement.engine_mesh)
        if not evaluator:
            evaluator.append(EpisodeEvaluator(c, task, graphdef, p, live_vocab=live, mesh=placement.engine_mesh))
        return evaluator[0].evaluations(p, stopping)

    return evaluate


def _policy(c: Config, placement: Placement, log: Callable[[str], None]):
    """(task, graphdef, params): released weights straight onto the learner mesh, or a fresh
    init and the supervised warm start; then `model.lora`'s fresh adapters, if any, on that base."""
    task, params = _base_policy(base_config(c), placement, log)
    graphdef, params = with_adapters(c.model, params, c.run.seed)
    return task, graphdef, params


def _base_policy(c: Config, placement: Placement, log: Callable[[str], None]):
    """(task, params) of the model without adapters: what LoRA freezes, or what full fine-tuning trains."""
    if c.model.hf_path:
        m = c.model
        _, graphdef, params = load_hf_model(
            m.hf_path, param_dtype=m.param_dtype, compute_dtype=m.compute_dtype, max_seq_len=m.max_seq_len,
            shardings=sharding.param_shardings(placement.learner_mesh, abstract_params(c.model)))
        task = make_task(c.task, load_tokenizer(m.hf_path, vocab_size=c.model.vocab_size))
        log(f"loaded {m.hf_path} ({c.model.n_layers} layers, width {c.model.d_model}); no warm start")
        return task, params
    task = make_task(c.task)
    graphdef, params = init_params(c.model, c.run.seed)
    if placement.kind == "multihost":  # the warm start runs SPMD on the global mesh, like the learner
        params = sharding.shard_params(params, placement.learner_mesh)
    start = time.perf_counter()
    params, cached = warm_start(graphdef, params, task, c, log=log,  # cached by its settings, shared by a sweep
                                stopping=_stop_poll(c, placement))
    if c.warmstart.steps:
        log(f"warm start {'loaded from cache' if cached else f'trained for {c.warmstart.steps} steps'} "
            f"({time.perf_counter() - start:.1f}s)")
    return task, params


def _stop_poll(c: Config, placement: Placement) -> Callable[[], Optional[int]]:
    """The stop signal the stages poll; multi-host, agreed by every process."""
    multihost = placement.kind == "multihost"
    return stop_poll(distributed.Coordinator(c.distributed.timeout_s) if multihost else None)


def _to_mesh(c: Config, placement: Placement) -> Callable[[Any], Any]:
    return weight_sync(sharding.param_shardings(placement.actor_mesh, abstract_params(c.model)))
