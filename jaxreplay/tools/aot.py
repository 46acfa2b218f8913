"""`jaxreplay compile`: does a config fit the chips it is meant for? Compiled, not guessed.

The real train step and the real samplers (rollouts at `prompts_per_step x group_size`
rows, greedy evaluation at `eval.EVAL_BATCH` rows), and the rollout engine's prefill and
decode chunk (a pool of as many slots as rollout rows; multi-turn, its answer prefill) are
lowered with abstract inputs (`jax.ShapeDtypeStruct` carrying their `NamedSharding`) at the
config's full shapes and compiled for a TPU slice (`topology.slice_devices`) or for the local
devices. No weight is allocated. XLA's memory analysis gives each program's per-device argument, output,
temporary and aliased bytes; their total is set against the device's HBM.

Colocated runs hold everything at once: while the samplers run, the optimizer state
(and the KL reference, if any) stays on the devices, so it is added to their totals.
With `model.lora`, the optimizer state is the adapters' alone (`learn.trainable`) and the
samplers apply the adapters on the fly, so the figures are those of the run as it trains.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxreplay.compat import flops_of
from jaxreplay.config import Config, ConfigError, config_from_raw, load_raw
from jaxreplay.models import lora, sharding
from jaxreplay.models.transformer import KV_CACHE_AXES
from jaxreplay.models.transformer import abstract_model, count_params

GiB = 1 << 30
# Decode steps per engine chunk compiled (the engine's default; the chunk's bytes barely depend on it).
ENGINE_CHUNK_STEPS = 8


class DoesNotFit(RuntimeError):
    """A program needs more memory per device than the device has; the message says which."""


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program's per-device memory (bytes), compile time and FLOPs."""

    name: str
    argument: int
    output: int
    alias: int  # outputs that reuse a donated argument's buffer
    temp: int
    held: int  # other live arrays the program does not take (optimizer state while sampling)
    compile_s: float
    flops: Optional[float]  # per device and step (train step only: XLA counts a decode loop's body once)
    oom: Optional[str] = None  # the TPU compiler refused it: what it needed against what it had

    @property
    def total(self) -> int:
        return self.argument + self.output - self.alias + self.temp + self.held


@dataclasses.dataclass(frozen=True)
class Report:
    target: str  # the slice name, or "local"
    device_kind: str
    n_devices: int
    hbm: Optional[int]  # bytes per device; None: no limit known (host CPU)
    libtpu: Optional[str]
    mesh: str
    model: str
    shapes: str
    kv_cache: int  # bytes per device of the rollout sampler's cache at its largest
    programs: tuple[Program, ...]

    def over(self) -> list[Program]:
        return [p for p in self.programs if p.oom or (self.hbm is not None and p.total > self.hbm)]

    def lines(self) -> list[str]:
        hbm = "no HBM limit" if self.hbm is None else f"{self.hbm / GiB:.1f} GiB HBM each"
        w = max([26] + [len(p.name) + 1 for p in self.programs])
        out = [f"target: {self.target}: {self.n_devices} x {self.device_kind} ({hbm})"
               + (f", libtpu {self.libtpu}" if self.libtpu else ""),
               f"mesh: {self.mesh}", f"model: {self.model}", f"shapes: {self.shapes}",
               f"KV cache: {self.kv_cache / GiB:.3f} GiB per device (rollout sampler, all slots)",
               f"{'per device, GiB':<{w}}{'argument':>9}{'output':>9}{'temp':>9}{'held':>9}{'total':>9}"
               f"{'of HBM':>8}{'compile s':>11}{'TFLOP':>9}"]
        for p in self.programs:
            if p.oom:
                out.append(f"{p.name:<{w}}does not compile: {p.oom} ({p.compile_s:.1f} s)")
                continue
            share = "" if self.hbm is None else f"{100 * p.total / self.hbm:.0f}%"
            flops = "" if p.flops is None else f"{p.flops / 1e12:.3f}"
            out.append(f"{p.name:<{w}}{p.argument / GiB:>9.2f}{(p.output - p.alias) / GiB:>9.2f}{p.temp / GiB:>9.2f}"
                       f"{p.held / GiB:>9.2f}{p.total / GiB:>9.2f}{share:>8}{p.compile_s:>11.1f}{flops:>9}")
        fits = "NO" if self.over() else ("unknown (no HBM limit on this platform)" if self.hbm is None else "yes")
        out.append(f"fits: {fits}")
        return out

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["programs"] = [{**dataclasses.asdict(p), "total": p.total} for p in self.programs]
        d["fits"] = None if self.hbm is None else not self.over()
        return d


def load_for_compile(path: str, overrides: list[str]) -> Config:
    """The config, with `model.hf_config` standing in for a missing `model.hf_path`: the
    architecture is all compiling needs, and the shipped config.json files provide it."""
    raw = load_raw(path, overrides)
    model = raw.get("model")
    if isinstance(model, dict) and not model.get("hf_path") and model.get("hf_config"):
        from jaxreplay.models.architectures import architecture_dir

        found = architecture_dir(str(model["hf_config"]))
        if found is None:
            raise ConfigError(f"model.hf_config: {model['hf_config']!r} names no config.json")
        model["hf_path"] = str(found)
    return config_from_raw(raw)


def compile_config(config: Config, topology: Optional[str] = None, log=print) -> Report:
    """Compiles the config's train step and samplers for `topology` (None: the local devices)."""
    from jaxreplay.tools.topology import hbm_bytes, libtpu_version, slice_devices

    devices = slice_devices(topology) if topology else jax.devices()
    config = _with_architecture(config)
    mesh = sharding.topology_mesh(config.mesh, devices)
    c, m = config, config.model
    rows = c.rollouts_per_step
    from jaxreplay.train.eval import EVAL_BATCH

    sharding.check_batch_sizes(mesh, {"train.batch_size": c.train.batch_size,
                                      "train.prompts_per_step * train.group_size": rows,
                                      "eval batch (eval.EVAL_BATCH)": EVAL_BATCH,
                                      **({"train.micro_batch_size": c.train.micro_batch_size}
                                         if c.train.micro_batch_size else {})})
    graphdef, abstract = abstract_model(m)
    from jaxreplay.tasks.registry import prompt_len

    p_len = prompt_len(c.task)
    length = p_len + c.sampling.max_new_tokens
    log(f"compiling for {topology or 'the local devices'} ({len(devices)} x {devices[0].device_kind}), "
        f"mesh {sharding.describe(mesh)}")

    params = _placed(abstract, sharding.param_shardings(mesh, abstract))
    from jaxreplay.learn.learner import make_optimizer

    optimizer = make_optimizer(c.train)
    opt_abstract = jax.eval_shape(optimizer.init, abstract)
    opt_state = _placed(opt_abstract, sharding.param_shardings(mesh, opt_abstract))
    ref = params if c.train.kl_coef > 0 and not lora.enabled(m) else None  # LoRA's reference: the base itself
    held = _device_bytes(opt_state) + (_device_bytes(ref) if ref is not None else 0)

    programs = [_train_program(graphdef, c, optimizer, mesh, params, opt_state, ref, length, log)]
    programs += _sampler_programs(graphdef, c, mesh, params, p_len, {"rollout": rows, "eval": EVAL_BATCH}, held, log)
    programs += _engine_programs(graphdef, c, *_engine_placement(c, mesh, topology, devices, abstract, params),
                                 p_len, held, log)
    cache = jax.ShapeDtypeStruct((rows, m.n_kv_heads, length, m.head_dim), jnp.dtype(
        c.sampling.kv_cache_dtype or m.compute_dtype))
    cache_shard = sharding.cache_sharding(mesh, KV_CACHE_AXES, cache.shape).shard_shape(cache.shape)
    kv = 2 * m.n_layers * math.prod(cache_shard) * cache.dtype.itemsize
    family = architecture_name(m)
    return Report(
        target=topology or "local", device_kind=devices[0].device_kind, n_devices=len(devices),
        hbm=hbm_bytes(devices[0]), libtpu=libtpu_version() if topology else None, mesh=sharding.describe(mesh),
        model=(f"{count_params(lora.split_adapters(abstract)[1]):,} params ({family}-style, {m.n_layers} layers, "
               f"d_model {m.d_model}, vocab {m.vocab_size}; {m.param_dtype} weights, {m.compute_dtype} compute)"
               + (f" from {Path(m.hf_path).name}" if m.hf_path else "")
               + (f"; LoRA rank {m.lora.rank} on {', '.join(m.lora.targets)}: {lora.count_trainable(abstract):,} "
                  f"trainable" if lora.enabled(m) else "")),
        shapes=(f"train {c.train.batch_size} x {length} tokens (micro-batch {c.train.micro_batch_size or 'off'}, "
                f"remat {c.train.remat}, logits chunk {c.train.logits_chunk_size or 'off'}); sampler {rows} x "
                f"({p_len} prompt + {c.sampling.max_new_tokens} new) tokens (prefill chunk "
                f"{c.sampling.prefill_chunk_size or 'off'})"),
        kv_cache=kv, programs=tuple(programs))


def check_fits(report: Report) -> None:
    """Raises `DoesNotFit` naming the first program over the device's HBM."""
    over = report.over()
    if over:
        p, where = over[0], f"{report.device_kind} ({report.target}, mesh {report.mesh})"
        if p.oom:
            raise DoesNotFit(f"{p.name} does not fit a {where}: {p.oom}")
        raise DoesNotFit(f"{p.name} needs {p.total / GiB:.2f} GiB per device, over the {report.hbm / GiB:.1f} GiB HBM "
                         f"of a {where}")


def architecture_name(m) -> str:
    """The HF family whose features the model has (`hf.family_of`: gemma3_text, qwen3_moe, ...), or "custom"."""
    from jaxreplay.models.errors import HFModelError
    from jaxreplay.models.hf import family_of

    try:
        return family_of(m)
    except HFModelError:
        return "custom"


def _with_architecture(config: Config) -> Config:
    """The config with the architecture of `model.hf_path`'s config.json, as training reads it."""
    m = config.model
    if m.hf_path is None:
        return config
    from jaxreplay.models.hf import read_model_config

    cfg = read_model_config(m.hf_path, param_dtype=m.param_dtype, compute_dtype=m.compute_dtype,
                            max_seq_len=m.max_seq_len)
    return dataclasses.replace(config, model=dataclasses.replace(cfg, lora=m.lora, moe_dispatch=m.moe_dispatch))


def _placed(tree: Any, shardings: Any) -> Any:
    """Abstract arrays (ShapeDtypeStruct leaves) carrying the matching shardings."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def _device_bytes(tree: Any) -> int:
    """Bytes one device holds of the placed abstract arrays in `tree`."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _train_program(graphdef, c: Config, optimizer, mesh, params, opt_state, ref, length: int, log) -> Program:
    from jaxreplay.learn.learner import make_train_step

    rows = sharding.batch_sharding(mesh)
    b = c.train.batch_size
    batch = {
        "tokens": jax.ShapeDtypeStruct((b, length), jnp.int32, sharding=rows),
        "attention_mask": jax.ShapeDtypeStruct((b, length), jnp.bool_, sharding=rows),
        "completion_mask": jax.ShapeDtypeStruct((b, length), jnp.bool_, sharding=rows),
        "logprobs": jax.ShapeDtypeStruct((b, length), jnp.float32, sharding=rows),
        "advantage": jax.ShapeDtypeStruct((b,), jnp.float32, sharding=rows),
    }
    step = make_train_step(graphdef, c, optimizer, mesh)
    program = _compiled("train step", step, (params, opt_state, batch, ref), 0, log)
    # XLA's cost analysis counts a loop body once: the micro-batch scan runs it b / micro times
    # (the optimizer update outside it is overcounted as much, a negligible share).
    repeats = b // (c.train.micro_batch_size or b)
    return program if program.flops is None else dataclasses.replace(program, flops=program.flops * repeats)


def _sampler_programs(graphdef, c: Config, mesh, params, p_len: int, batches: dict[str, int], held: int,
                      log) -> list[Program]:
    from jaxreplay.rollout.sampling import make_run_samplers

    rollout, greedy = make_run_samplers(graphdef, c, stop_ids=(), pad_id=0, mesh=mesh)
    rows = sharding.batch_sharding(mesh)
    like = jax.eval_shape(jax.random.PRNGKey, 0)
    key = jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=sharding.replicated(mesh))
    programs = []
    for (name, n), fn in zip(batches.items(), (rollout, greedy)):
        prompts = jax.ShapeDtypeStruct((n, p_len), jnp.int32, sharding=rows)
        mask = jax.ShapeDtypeStruct((n, p_len), jnp.bool_, sharding=rows)
        program = _compiled(f"{name} sampler ({n} rows)", fn, (params, prompts, mask, key), held, log)
        programs.append(dataclasses.replace(program, flops=None))
    return programs


def _engine_placement(c: Config, mesh, topology: Optional[str], devices, abstract,
                      params) -> tuple[Any, Any, int, int]:
    """(mesh, weights, slots, other bytes held) of the engine as a run places it. Multi-host
    (`distributed.enabled` on a slice of several hosts), each host's engine runs on its own
    chips (`sharding.process_local_mesh`) with its share of the slots, and its weight copy sits
    beside the learner's params; otherwise it shares the learner's mesh and weights."""
    from jaxreplay.rollout.actor import engine_slots
    from jaxreplay.tools.topology import host_devices

    hosts = len({d.process_index for d in devices})
    if not (c.distributed.enabled and hosts > 1):
        return mesh, params, engine_slots(c), 0
    local = sharding.process_local_mesh(mesh, host_devices(topology) if topology else None)
    return local, _placed(abstract, sharding.param_shardings(local, abstract)), engine_slots(c, hosts), \
        _device_bytes(params)


def _engine_programs(graphdef, c: Config, mesh, params, slots: int, engine_held: int, p_len: int, held: int,
                     log) -> list[Program]:
    """The rollout engine's prefill into prefix entries and its start of whole groups straight
    into slots (each at its largest call), and its decode chunk (at the full window: every slot
    P + N columns), with its pool of `slots`, laid out as the engine lays it out
    (`engine.state_shardings`). Multi-turn (`environment.name`), also its largest answer
    prefill (`engine.largest_answer_prefill`), which gathers its rows' cache."""
    from jaxreplay.rollout import engine
    from jaxreplay.rollout.rollouts import records_routes

    s = c.sampling
    programs = engine.programs(
        graphdef, c.model, group_size=c.train.group_size, prompt_len=p_len, max_new_tokens=s.max_new_tokens,
        chunk_steps=ENGINE_CHUNK_STEPS, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        kv_cache_dtype=s.kv_cache_dtype, prefill_chunk_size=s.prefill_chunk_size, mesh=mesh, slots=slots,
        record_routes=records_routes(c))
    pool, prefixes, n = engine.abstract_state(c.model, slots, c.train.group_size, p_len, s.max_new_tokens,
                                              s.kv_cache_dtype, record_routes=records_routes(c))
    pool_at, prefixes_at = engine.state_shardings(mesh, pool, prefixes)
    place = lambda x, where: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where)
    pool, prefixes = jax.tree.map(place, pool, pool_at), jax.tree.map(place, prefixes, prefixes_at)
    rep = sharding.replicated(mesh)
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    per_prompt = lambda dtype, *shape, n=n: jax.ShapeDtypeStruct((n, *shape), dtype, sharding=rep)
    g = c.train.group_size
    whole = 1 << (max(slots // g, 1).bit_length() - 1)  # the most groups one start call takes
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), whole))
    width = p_len + s.max_new_tokens
    held += engine_held
    where = f", each host on its {mesh.devices.size} devices" if engine_held else ""  # multi-host
    compiled = [
        dataclasses.replace(_compiled(f"engine prefill ({n} prompts{where})", programs.prefill, (
            params, prefixes, per_prompt(jnp.int32, p_len), per_prompt(jnp.bool_, p_len), per_prompt(jnp.int32),
            scalar), held, log), flops=None),
        dataclasses.replace(_compiled(f"engine start ({whole} prompts into {whole * g} slots{where})",
                                      programs.start, (
            params, pool, per_prompt(jnp.int32, p_len, n=whole), per_prompt(jnp.bool_, p_len, n=whole),
            jax.ShapeDtypeStruct((whole * g,), jnp.int32, sharding=rep), place(keys, rep), scalar), held, log),
            flops=None),
        dataclasses.replace(_compiled(f"engine decode chunk ({slots} slots{where})", programs.decode, (
            width, False, params, pool, jax.ShapeDtypeStruct((slots,), jnp.int32, sharding=rep), scalar, scalar),
            held, log),
            flops=None),
    ]
    answers = engine.largest_answer_prefill(slots, s.max_new_tokens, mesh) if c.environment.name else None
    if answers is not None:
        rows, length = answers
        per_row = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=rep)
        compiled.append(dataclasses.replace(_compiled(
            f"engine answer prefill ({rows} rows x {length} tokens{where})", programs.feed,
            (length, params, pool, per_row, per_row, scalar), held, log), flops=None))
    return compiled


# The TPU compiler refuses a program over HBM ("CompileTimeHbmOom") rather than compiling it.
_HBM_OOM = re.compile(r"Ran out of memory on HBM, the total memory required for (.+?) \(([\d.]+[KMGT]?)\) exceeds "
                      r"available HBM \(([\d.]+[KMGT]?)\)")


def _compiled(name: str, fn, args: tuple, held: int, log) -> Program:
    log(f"compiling the {name}...")
    start = time.perf_counter()
    try:
        compiled = fn.lower(*args).compile()
    except Exception as e:  # XLA raises its runtime error type, which differs between jax versions
        oom = _HBM_OOM.search(str(e))
        if oom is None:
            raise
        what, need, have = oom.groups()
        return Program(name=name, argument=0, output=0, alias=0, temp=0, held=held,
                       compile_s=time.perf_counter() - start, flops=None,
                       oom=f"the TPU compiler needs {need} for {what}, over the {have} of HBM it can use")
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    return Program(name=name, argument=mem.argument_size_in_bytes, output=mem.output_size_in_bytes,
                   alias=mem.alias_size_in_bytes, temp=mem.temp_size_in_bytes, held=held, compile_s=seconds,
                   flops=flops_of(compiled))
