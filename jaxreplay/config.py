"""Typed run configuration: YAML file + dotted overrides, validated once at the edge.

Every section is a frozen dataclass. `load_config` is the only way in: it rejects
unknown keys, wrong types and impossible values (including rate-limiter settings
that would deadlock) with a `ConfigError` whose one-line message names the key.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the offending key."""


Selector = Literal["uniform", "fifo", "lifo", "prioritized"]
DType = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class ModelConfig:
    """A Llama/Qwen2/Qwen3-family decoder."""

    vocab_size: int = 32
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    d_ff: int = 384
    max_seq_len: int = 16
    rope_theta: float = 10_000.0
    # Llama 3.1+ RoPE scaling (HF rope_type "llama3"); a factor of 1 is plain RoPE.
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    attention_bias: bool = False
    qk_norm: bool = False
    param_dtype: DType = "float32"
    compute_dtype: DType = "float32"
    # A local Hugging Face model directory: its config.json replaces every architecture key
    # above (all but max_seq_len and the dtypes) and its safetensors the initial weights.
    hf_path: Optional[str] = None


@dataclass(frozen=True)
class TaskConfig:
    """The prompt source and its reward.

    "arithmetic": the embedded `a+b=` task with an exact-match reward (the digit keys).
    "gsm8k", "math": local files at `path` (e.g. the Hub repository's Parquet shards), or
    without `path` TFDS datasets read from `data_dir` (never downloaded; needs TensorFlow).
    "jsonl", "parquet": local files of any dataset at `path`.
    `path`: a pattern with `{split}` for the split name (glob wildcards allowed) or a
    directory in a Hub dataset's layout; the file extension gives the format.
    Dataset keys left null take the source's defaults (tasks.datasets.SOURCES).
    """

    name: Literal["arithmetic", "gsm8k", "math", "jsonl", "parquet"] = "arithmetic"
    min_digits: int = 2
    max_digits: int = 2
    operations: tuple[str, ...] = ("+",)
    reverse_answer: bool = True  # least significant digit first: the order carries flow
    eval_size: int = 256
    data_seed: int = 1234
    path: Optional[str] = None  # e.g. data/{split}-*.parquet, data/{split}.jsonl or a Hub repository's directory
    data_dir: Optional[str] = None  # gsm8k/math without path: the TFDS data_dir (null: TFDS's default)
    tfds_name: Optional[str] = None  # gsm8k/math without path: the TFDS dataset name
    train_split: str = "train"
    eval_split: str = "test"
    prompt_field: Optional[str] = None
    answer_field: Optional[str] = None
    reward: Optional[str] = None  # tasks.rewards.REWARDS
    prompt_template: str = "{prompt}"
    chat_template: bool = False  # wrap the prompt in the tokenizer's chat template
    max_prompt_len: int = 256  # dataset prompts are left-padded to this many tokens
    long_prompts: Literal["skip", "error"] = "skip"  # prompts longer than max_prompt_len


@dataclass(frozen=True)
class WarmStartConfig:
    """Supervised warm start on a sloppy teacher's demonstrations, cached in the run dir.

    The teacher forgets its carries with probability `teacher_carry_error`, so the
    warm-started policy prefers the carry-free slip: low but non-zero accuracy, and a
    systematic error that RL with an exact-match reward can find and fix.
    """

    steps: int = 800
    batch_size: int = 64
    learning_rate: float = 1e-3
    teacher_carry_error: float = 0.75


@dataclass(frozen=True)
class SamplingConfig:
    """Rollout sampling; the learner scores with the same temperature."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    max_new_tokens: int = 5


@dataclass(frozen=True)
class ReplayConfig:
    """The Reverb table between actor and learner.

    mode "replay": selector over a FIFO window of `max_size` rollouts, rate-limited to
    `samples_per_insert`. mode "on_policy": the baseline queue, each rollout trained
    on exactly once, freshest first (selector/max_size/ratio settings are ignored).
    """

    mode: Literal["replay", "on_policy"] = "replay"
    selector: Selector = "uniform"
    priority_exponent: float = 1.0
    max_size: int = 512
    max_times_sampled: int = 0  # 0 = unlimited
    samples_per_insert: float = 2.0
    min_size_to_sample: int = 128
    error_buffer: Optional[float] = None  # None: batch_size + samples_per_insert
    positive_fraction: float = 0.0  # d > 0: a second table keeps the freshest dN correct rollouts
    calibrate_steps: int = 0  # > 0: samples_per_insert from the mu measured over this many calls (calibrate.py)
    cost_rho: float = 0.1  # rho of the cost model used by calibration
    timeout_s: float = 60.0
    port: int = 0  # 0 picks a free port
    backend: Literal["auto", "reverb", "inprocess"] = "auto"  # auto: reverb where installed (replay/__init__.py)


@dataclass(frozen=True)
class TrainConfig:
    """Learner and actor shapes and the GRPO/PPO update."""

    steps: int = 300
    batch_size: int = 64  # rollouts per learner step (B)
    prompts_per_step: int = 8  # prompts per actor step; R = prompts_per_step * group_size
    group_size: int = 8  # G completions per prompt
    learning_rate: float = 3e-4
    warmup_steps: int = 10  # linear learning-rate warm-up, then constant
    weight_decay: float = 0.0
    adam_b1: float = 0.9
    adam_b2: float = 0.99
    grad_clip: float = 1.0
    max_nonfinite_steps: int = 5  # this many non-finite (skipped) updates in a row stop the run
    eps_low: float = 0.2
    eps_high: float = 0.2
    kl_coef: float = 0.0  # > 0 adds k3 KL to the warm-start reference policy
    eval_every: int = 20
    weight_sync_every: int = 1  # disaggregated mode: learner steps between weight pushes to the actor
    loss: Literal["grpo", "tis", "asymre"] = "grpo"  # rl.losses.LOSSES
    advantage: Literal["group_normalized", "group_centered", "leave_one_out"] = "group_normalized"
    loss_aggregation: Literal["token_mean", "sequence_mean", "constant"] = "token_mean"
    tis_cap: float = 2.0  # truncated importance sampling: ratio capped here
    asymre_delta_v: float = -0.1  # AsymRE: advantage r - (V + dV)


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 50  # learner steps between checkpoints (Orbax + Reverb together)
    keep: int = 2


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh: data, fsdp and tensor parallel sizes; -1 (at most one) takes the rest.

    actor_devices = 0: colocated, one mesh for sampling and training. actor_devices > 0:
    disaggregated, the first `actor_devices` devices form the actor's mesh (`actor_tensor`
    tensor-parallel, data-parallel over the rest) and the sizes above apply to the
    learner's mesh over the remaining devices. Whether the mesh fits the machine is
    checked where it is built (`sharding.make_mesh`), since that needs the device count.
    """

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    actor_devices: int = 0
    actor_tensor: int = 1


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-host SPMD (`jaxreplay.multihost`): every process runs the same program.

    enabled false: one process. Otherwise `jax.distributed.initialize` gets the values
    set here; unset ones ("", 0, -1) are left to JAX's JAX_COORDINATOR_ADDRESS variable
    and cluster auto-detection (TPU pod metadata, SLURM, Open MPI).
    """

    enabled: bool = False
    coordinator_address: str = ""  # "host:port" of process 0
    num_processes: int = 0  # 0: detected
    process_id: int = -1  # -1: detected
    replay_address: str = ""  # "host:port" of process 0's Reverb server; "": the coordinator's host
    timeout_s: float = 300.0  # start-up, barriers and every wait on another process


@dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/demo"
    seed: int = 0
    progress_bar: bool = True


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def rollouts_per_step(self) -> int:
        return self.train.prompts_per_step * self.train.group_size

    @property
    def error_buffer(self) -> float:
        """The limiter's error buffer, resolving the default."""
        r, t = self.replay, self.train
        return r.error_buffer if r.error_buffer is not None else float(t.batch_size + r.samples_per_insert)


# ----------------------------------------------------------------------------------
# Parsing and printing


def to_dict(config: Config) -> dict[str, Any]:
    """Plain nested dict (tuples as lists): what `load_config` reads back unchanged."""

    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, tuple):
            return [plain(v) for v in x]
        return x

    return plain(dataclasses.asdict(config))


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = (), *, local: bool = True) -> Config:
    """Reads YAML (or the defaults when `path` is None), applies `a.b=value` overrides, validates.

    `local=False` checks a config that will run on other machines (the TPU launcher's
    workers): what this machine has installed or on disk is not checked (see `validate`)."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"malformed YAML in {path}{where}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
    for item in overrides:
        _apply_override(raw, item)
    config = _build(Config, raw, prefix="")
    validate(config, local=local)
    return config


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    node = raw
    *parents, leaf = key.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: {part} is not a section")
        node = child
    node[leaf] = value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]} (known: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = _coerce(hints[name], value, f"{prefix}{name}")
    return cls(**kwargs)


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, prefix=f"{key}.")
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if origin is tuple:
        (inner, _) = typing.get_args(tp)
        items = value if isinstance(value, (list, tuple)) else [value]
        return tuple(_coerce(inner, v, f"{key}[{i}]") for i, v in enumerate(items))
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads "1e-3" as a string
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    else:  # pragma: no cover - a field type this parser does not know is a bug here
        raise TypeError(f"unsupported config type {tp} for {key}")
    raise ConfigError(f"{key}: expected {tp.__name__}, got {type(value).__name__} {value!r}")


# ----------------------------------------------------------------------------------
# Validation: impossible values and rate-limiter settings that would deadlock.


def _require(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why}")


def validate(c: Config, local: bool = True) -> None:
    """Every rule below; with `local`, also that this machine can run `c` (`_validate_machine`)."""
    m, t, s, r, w = c.model, c.train, c.sampling, c.replay, c.warmstart
    for key, value in [
        ("model.vocab_size", m.vocab_size), ("model.d_model", m.d_model), ("model.n_layers", m.n_layers),
        ("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads), ("model.head_dim", m.head_dim),
        ("model.d_ff", m.d_ff), ("model.max_seq_len", m.max_seq_len), ("train.steps", t.steps),
        ("train.batch_size", t.batch_size), ("train.prompts_per_step", t.prompts_per_step),
        ("train.group_size", t.group_size), ("train.eval_every", t.eval_every),
        ("train.max_nonfinite_steps", t.max_nonfinite_steps),
        ("sampling.max_new_tokens", s.max_new_tokens), ("checkpoint.every", c.checkpoint.every),
        ("checkpoint.keep", c.checkpoint.keep), ("replay.max_size", r.max_size),
        ("replay.min_size_to_sample", r.min_size_to_sample), ("task.eval_size", c.task.eval_size),
        ("warmstart.batch_size", w.batch_size), ("task.min_digits", c.task.min_digits),
    ]:
        _require(value > 0, key, f"must be positive, got {value}")
    _require(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
             f"must divide model.n_heads ({m.n_heads}), got {m.n_kv_heads}")
    _require(m.head_dim % 2 == 0, "model.head_dim", f"must be even for RoPE, got {m.head_dim}")
    _require(m.rope_theta > 0, "model.rope_theta", "must be positive")
    _require(m.rope_scaling_factor >= 1, "model.rope_scaling_factor", f"must be >= 1, got {m.rope_scaling_factor}")
    _require(0 < m.rope_low_freq_factor < m.rope_high_freq_factor, "model.rope_high_freq_factor",
             f"must exceed model.rope_low_freq_factor ({m.rope_low_freq_factor}), which must be positive")
    _require(m.rope_original_max_len > 0, "model.rope_original_max_len", "must be positive")
    _require(m.norm_eps > 0, "model.norm_eps", "must be positive")
    _require(c.task.max_digits >= c.task.min_digits, "task.max_digits",
             f"must be >= task.min_digits ({c.task.min_digits})")
    _require(c.task.max_digits <= 9, "task.max_digits", "at most 9 digits are supported")
    for i, op in enumerate(c.task.operations):
        _require(op in ("+", "-", "*"), f"task.operations[{i}]", f"{op!r} is not one of +, -, *")
    _require(len(c.task.operations) > 0, "task.operations", "needs at least one operation")
    _require(w.steps >= 0, "warmstart.steps", f"must be >= 0, got {w.steps}")
    _require(w.learning_rate > 0, "warmstart.learning_rate", "must be positive")
    _require(0 <= w.teacher_carry_error <= 1, "warmstart.teacher_carry_error", "must be in [0, 1]")
    _require(s.temperature > 0, "sampling.temperature", f"must be positive, got {s.temperature}")
    _require(0 < s.top_p <= 1, "sampling.top_p", f"must be in (0, 1], got {s.top_p}")
    _require(s.top_k >= 0, "sampling.top_k", f"must be >= 0 (0 disables), got {s.top_k}")
    _require(t.learning_rate > 0, "train.learning_rate", "must be positive")
    _require(t.weight_decay >= 0, "train.weight_decay", "must be >= 0")
    _require(t.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
    _require(t.grad_clip > 0, "train.grad_clip", "must be positive")
    _require(0 <= t.eps_low < 1, "train.eps_low", f"must be in [0, 1), got {t.eps_low}")
    _require(t.eps_high >= 0, "train.eps_high", f"must be >= 0, got {t.eps_high}")
    _require(t.kl_coef >= 0, "train.kl_coef", "must be >= 0")
    _require(t.tis_cap > 0, "train.tis_cap", f"must be positive, got {t.tis_cap}")
    _require(t.loss != "asymre" or t.advantage != "group_normalized", "train.advantage",
             "AsymRE needs r - V: use group_centered or leave_one_out, not group_normalized")
    _require(t.group_size >= 2, "train.group_size", "needs at least 2 completions per prompt for group advantages")
    _require(r.timeout_s > 0, "replay.timeout_s", "must be positive")
    _require(r.max_times_sampled >= 0, "replay.max_times_sampled", "must be >= 0 (0 = unlimited)")
    _require(0 <= r.port < 65536, "replay.port", "must be a TCP port or 0")
    _require(r.priority_exponent >= 0, "replay.priority_exponent", "must be >= 0")
    _require(0 <= r.positive_fraction < 1, "replay.positive_fraction", f"must be in [0, 1), got {r.positive_fraction}")
    _require(r.calibrate_steps >= 0, "replay.calibrate_steps", f"must be >= 0 (0 = off), got {r.calibrate_steps}")
    _require(r.cost_rho > 0, "replay.cost_rho", f"must be positive, got {r.cost_rho}")
    _require(c.run.dir != "", "run.dir", "must not be empty")
    _require(m.max_seq_len >= _prompt_len(c) + s.max_new_tokens, "model.max_seq_len",
             f"{m.max_seq_len} is too short for prompts of {_prompt_len(c)} tokens plus "
             f"sampling.max_new_tokens={s.max_new_tokens}")
    _validate_task(c)
    _validate_replay(c)
    _validate_mesh(c)
    _validate_distributed(c)
    if c.distributed.enabled:  # the replay package owns what sharding a table across processes means
        from jaxreplay.replay.multiprocess import check_multiprocess

        check_multiprocess(c, c.distributed.num_processes or None)
    if local:
        _validate_machine(c)


def _validate_machine(c: Config) -> None:
    """What this machine must have to run `c`: Reverb installed, the model directory on disk."""
    _require(c.replay.backend != "reverb" or importlib.util.find_spec("reverb") is not None, "replay.backend",
             "reverb is not installed (pip install 'jaxreplay[reverb]', Python 3.10/3.11), or use inprocess")
    hf_path = c.model.hf_path
    _require(hf_path is None or (Path(hf_path) / "config.json").is_file(), "model.hf_path",
             f"{hf_path} is not a Hugging Face model directory (no config.json)")


def _validate_task(c: Config) -> None:
    if c.task.name != "arithmetic":
        from jaxreplay.tasks.datasets import validate_task_config  # the task owns its keys

        validate_task_config(c)
        return
    _require(c.task.reward is None, "task.reward", "must be null for the arithmetic task (it has its own exact match)")
    from jaxreplay.tasks.arithmetic import CharTokenizer  # the task owns its vocabulary

    vocab = CharTokenizer().vocab_size
    _require(c.model.vocab_size >= vocab, "model.vocab_size",
             f"{c.model.vocab_size} is smaller than the task tokenizer's vocabulary ({vocab})")


def _prompt_len(c: Config) -> int:
    if c.task.name != "arithmetic":
        return c.task.max_prompt_len
    from jaxreplay.tasks.arithmetic import prompt_length  # the task owns its prompt format

    return prompt_length(c.task)


def _validate_replay(c: Config) -> None:
    """Rejects limiter settings that deadlock the colocated scheduler.

    The scheduler inserts rollouts one at a time and samples `batch_size` at once.
    With D = inserts * spi - samples, Reverb admits an insert while D + spi <= max_diff
    and a sample of B while D - B >= min_diff. Some move is always possible iff the
    window max_diff - min_diff = 2 * error_buffer is at least B + spi.
    """
    r, t = c.replay, c.train
    b = t.batch_size
    if r.mode == "on_policy":
        return  # the queue is sized from the batch: see replay.tables
    spi = r.samples_per_insert
    _require(spi > 0, "replay.samples_per_insert", f"must be positive, got {spi}")
    _require(r.min_size_to_sample <= r.max_size, "replay.min_size_to_sample",
             f"{r.min_size_to_sample} exceeds replay.max_size={r.max_size}: the table can never fill enough to sample")
    _require(b <= r.max_size, "train.batch_size",
             f"{b} is larger than replay.max_size={r.max_size}, which the table can never hold")
    main = r.max_size - round(r.positive_fraction * r.max_size)  # see replay.tables.positive_split
    _require(r.min_size_to_sample <= main, "replay.positive_fraction",
             f"{r.positive_fraction} leaves the rollout table {main} rows, fewer than "
             f"replay.min_size_to_sample={r.min_size_to_sample}")
    # max_times_sampled > 0 is safe because the loop then assembles batches row by row (replay.reader.
    # IncrementalReader): if no insert is admitted, the table holds >= min_size_to_sample rows and
    # diff > max_diff - spi >= min_diff + B, so one more row can always be sampled without blocking.
    _require(r.max_times_sampled == 0 or r.positive_fraction == 0, "replay.max_times_sampled",
             "cannot be combined with replay.positive_fraction")
    eb = c.error_buffer
    _require(eb >= max(1.0, spi), "replay.error_buffer",
             f"{eb} is below max(1, samples_per_insert)={max(1.0, spi)}: Reverb rejects so narrow a window")
    _require(2 * eb >= b + spi, "replay.error_buffer",
             f"{eb} deadlocks: the limiter window 2*error_buffer={2 * eb} must hold one batch plus one insert "
             f"(train.batch_size + samples_per_insert = {b + spi}); raise it to at least {(b + spi) / 2}")


def _validate_mesh(c: Config) -> None:
    """Shapes alone; the fit to the machine's devices is checked by `sharding.make_mesh`."""
    m = c.mesh
    sizes = {"mesh.data": m.data, "mesh.fsdp": m.fsdp, "mesh.tensor": m.tensor}
    for key, value in sizes.items():
        _require(value > 0 or value == -1, key, f"must be positive or -1 (the rest), got {value}")
    rest = [k for k, v in sizes.items() if v == -1]
    _require(len(rest) <= 1, rest[-1] if rest else "mesh", f"only one mesh size may be -1, got {', '.join(rest)}")
    _require(m.actor_devices >= 0, "mesh.actor_devices", f"must be >= 0 (0 = colocated), got {m.actor_devices}")
    _require(m.actor_tensor > 0, "mesh.actor_tensor", f"must be positive, got {m.actor_tensor}")
    if m.actor_devices:
        _require(m.actor_devices % m.actor_tensor == 0, "mesh.actor_tensor",
                 f"{m.actor_tensor} does not divide mesh.actor_devices={m.actor_devices}")
    _require(c.train.weight_sync_every > 0, "train.weight_sync_every",
             f"must be positive, got {c.train.weight_sync_every}")


def _validate_distributed(c: Config) -> None:
    d = c.distributed
    _require(d.num_processes >= 0, "distributed.num_processes", f"must be >= 0 (0 = detected), got {d.num_processes}")
    _require(d.process_id >= -1, "distributed.process_id", f"must be >= 0, or -1 (detected), got {d.process_id}")
    _require(d.num_processes == 0 or d.process_id < d.num_processes, "distributed.process_id",
             f"{d.process_id} is not below distributed.num_processes={d.num_processes}")
    _require(d.timeout_s > 0, "distributed.timeout_s", f"must be positive, got {d.timeout_s}")
    for key, address in [("distributed.coordinator_address", d.coordinator_address),
                         ("distributed.replay_address", d.replay_address)]:
        host, sep, port = address.rpartition(":")
        _require(not address or (sep and host and port.isdigit() and 0 < int(port) < 65536), key,
                 f"{address!r} is not of the form host:port")
