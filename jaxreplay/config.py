"""Typed run configuration: YAML file + dotted overrides, validated once at the edge.

Every section is a frozen dataclass. `load_config` is the only way in: it rejects
unknown keys, wrong types and impossible values (including rate-limiter settings
that would deadlock) with a `ConfigError` whose one-line message names the key.
Number fields are checked by type (floats finite, ints within 32 bits) and against
`RANGES`; the modules in `OWNERS` check their own keys (`owner_check`).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import os
import re
import stat
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import yaml

from jaxreplay import storage


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
    # The architecture alone, for `jaxreplay compile` when hf_path is not given: a directory
    # holding a config.json, or the name of one shipped in jaxreplay/architectures.
    hf_config: Optional[str] = None


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
    scratchpad: bool = False  # arithmetic, '+' only: work the columns (digits, carry in, sum) before the answer
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
    """Supervised warm start on a sloppy teacher's demonstrations, cached by the settings that
    produce it (warmstart.py), so the runs of a sweep share one.

    The teacher forgets its carries with probability `teacher_carry_error`, so the
    warm-started policy prefers the carry-free slip: low but non-zero accuracy, and a
    systematic error that RL with an exact-match reward can find and fix.
    """

    steps: int = 800
    batch_size: int = 64
    learning_rate: float = 1e-3
    teacher_carry_error: float = 0.75
    cache_dir: str = ""  # "": RUN_DIR/../.warmstart-cache, shared by the runs under one parent (a sweep's)


@dataclass(frozen=True)
class SamplingConfig:
    """Rollout sampling; the learner scores with the same temperature."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    max_new_tokens: int = 5
    kv_cache_dtype: Optional[DType] = None  # None: model.compute_dtype
    prefill_chunk_size: int = 0  # prompt tokens prefilled per model call (0: the whole prompt at once)
    # How the actor generates: "static" decodes each prompt batch in one call; "continuous" streams prompt
    # groups through the rollout engine's slot pool, each group entering the table as it completes.
    engine: Literal["static", "continuous"] = "static"
    # continuous: decode slots in the engine's pool (0: train.prompts_per_step * train.group_size per process).
    engine_slots: int = 0
    # continuous: decode steps per jitted chunk; between chunks the host refills slots, hands completed
    # groups to the table and sees stop signals.
    engine_chunk_steps: int = 8


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
    # Freshness knobs, each off by default (README "Replay knobs"):
    max_age: int = 0  # K > 0: never sample, and evict, rollouts more than K policy versions old
    fresh_fraction: float = 0.0  # f > 0: round(fB) rows of every batch from the newest actor step's rollouts
    priority_decay: float = 1.0  # prioritized selector: priority x decay ** age (1: no decay)
    drop_zero_advantage_groups: bool = False  # groups whose advantages are all 0 are never inserted
    calibrate_steps: int = 0  # > 0: samples_per_insert from the mu measured over this many calls (calibrate.py)
    cost_rho: float = 0.1  # rho of the cost model used by calibration
    timeout_s: float = 60.0
    port: int = 0  # 0 picks a free port
    backend: Literal["auto", "reverb", "inprocess"] = "auto"  # auto: reverb where installed (replay/__init__.py)


@dataclass(frozen=True)
class TrainConfig:
    """Learner and actor shapes and the GRPO/PPO update."""

    steps: int = 300
    # Equal-budget comparisons: also stop at the first learner step once the actor generated this many
    # completion tokens (0: off), and evaluate after the first step past each multiple of eval_every_tokens.
    max_generated_tokens: float = 0.0  # a float, so budgets past 2**31 tokens can be written (2e9)
    eval_every_tokens: float = 0.0
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
    loss: Literal["grpo", "tis", "asymre"] = "grpo"  # learn.losses.LOSSES
    advantage: Literal["group_normalized", "group_centered", "leave_one_out"] = "group_normalized"
    loss_aggregation: Literal["token_mean", "sequence_mean", "constant"] = "token_mean"
    tis_cap: float = 2.0  # truncated importance sampling: ratio capped here
    asymre_delta_v: float = -0.1  # AsymRE: advantage r - (V + dV)
    micro_batch_size: int = 0  # rows per forward/backward pass, gradients summed over the batch (0: all)
    remat: Literal["none", "full", "dots"] = "none"  # models.transformer.REMAT_POLICIES, per decoder block
    logits_chunk_size: int = 0  # positions unembedded at a time by the learner (0: all at once)
    adam_mu_dtype: Optional[DType] = None  # Adam's first moment (None: the params' dtype)


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 50  # learner steps between checkpoints (Orbax + Reverb together)
    every_seconds: float = 0.0  # also checkpoint once this long has passed since the last one (0: off)
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
    topology: Optional[str] = None  # the TPU slice the config is sized for (jaxreplay.tools.topology), e.g. v5e-8


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-host SPMD (the driver's multihost placement): every process runs the same program.

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
    # A process silent this long is dead: the coordination service fails every other process's
    # waits, so a killed peer stops the job in seconds (JAX's own default is 100 s).
    heartbeat_timeout_s: float = 10.0
    # Where process 0's coordination service listens; "": coordinator_address itself, so only
    # on that interface (JAX alone listens on every one). "[::]:PORT" for every interface.
    coordinator_bind_address: str = ""
    # Mutual TLS between the coordination service and its clients (pods on shared networks):
    # PEM files, all three or none; jax 0.12 only (the Reverb tier's jax 0.4.34 has none).
    mtls_cert_file: str = ""
    mtls_key_file: str = ""
    mtls_ca_file: str = ""
    mtls_peer_uri_prefix: str = ""  # accept a peer by a URI SAN prefix (e.g. "spiffe://example.org/")


@dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/demo"  # a local path or a bucket URL (gs://BUCKET/PATH)
    seed: int = 0
    progress_bar: bool = True
    lease_s: float = 60.0  # a bucket run dir's lock: how long a preempted run's lease blocks the resume


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases tracking (the `tracking` extra; train/tracking.py), beside metrics.jsonl and
    TensorBoard. "offline" writes W&B's run files under RUN_DIR/wandb for `wandb sync` later (TPU
    workers without outbound access); a resume continues the same W&B run (its id in RUN_DIR/wandb.json)."""

    mode: Literal["disabled", "offline", "online"] = "disabled"
    project: str = "jaxreplay"
    entity: Optional[str] = None  # None: the W&B account's default entity
    name: Optional[str] = None  # the run's display name; None: the run dir's name


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
    wandb: WandbConfig = field(default_factory=WandbConfig)

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


def flatten(tree: typing.Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: a config's sections and keys as dotted keys (as overrides name them)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, typing.Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = (), *, local: bool = True) -> Config:
    """Reads YAML (or the defaults when `path` is None), applies `a.b=value` overrides, validates.

    `local=False` checks a config that will run on other machines (the TPU launcher's
    workers): what this machine has installed or on disk is not checked (see `validate`)."""
    return config_from_raw(load_raw(path, overrides), local=local)


def load_raw(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> dict[str, Any]:
    """The YAML mapping of `path` with the overrides applied, not yet typed or validated."""
    raw: Any = {}
    if path is not None:
        raw = read_yaml(path, "config file")
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
    for item in overrides:
        _apply_override(raw, item)
    return raw


def config_from_raw(raw: dict[str, Any], local: bool = True) -> Config:
    """The typed, validated Config of a `load_raw` mapping (`local`: as `load_config`)."""
    check_expansion(raw, "config")
    config = _build(Config, raw, prefix="")
    validate(config, local=local)
    return config


# What a config may be: configs are a few hundred values, so these bounds only stop
# abuse (an alias bomb expands a few hundred bytes into gigabytes when walked or printed).
MAX_FILE_BYTES = 1 << 20
MAX_VALUES = 10_000  # nodes after alias expansion
MAX_TEXT = 1 << 20  # characters of all strings after alias expansion
MAX_ECHO = 80  # characters of a value quoted in an error message


def show(value: Any, limit: int = MAX_ECHO) -> str:
    """`repr(value)`, cut to `limit` characters: what an error message may echo of user input."""
    try:
        text = repr(value)
    except ValueError:  # an int too long for str(); YAML cannot produce one, but be safe
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def _name(key: Any) -> str:
    """A key as written, cut to MAX_ECHO characters."""
    text = str(key)
    return text if len(text) <= MAX_ECHO else f"{text[:MAX_ECHO - 3]}..."


def read_yaml(path: str | Path, what: str) -> Any:
    """The YAML document in `path` (a `what`, e.g. "config file"), or a one-line `ConfigError`.

    Only regular files are read: a FIFO or device would block or never end. Duplicate keys
    are refused (YAML would silently keep the last), and so is a document whose aliases
    expand past `MAX_VALUES` values or `MAX_TEXT` characters.
    """
    where = f"{what} {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once; it is refused below
    except OSError as e:
        raise ConfigError(f"cannot read {where}: {e.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise ConfigError(f"cannot read {where}: it is {kind}; give a YAML file")
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{where} is larger than {MAX_FILE_BYTES} bytes; a config is a few kilobytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})") from None
    try:
        raw = parse_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None)
        raise ConfigError(f"malformed YAML in {where}{at}" + (f": {problem[:200]}" if problem else "")) from None
    except RecursionError:
        raise ConfigError(f"malformed YAML in {where}: nested too deeply") from None
    except ValueError:  # an integer past Python's digit limit
        raise ConfigError(f"malformed YAML in {where}: a number too long to read") from None
    check_expansion(raw, where)
    return raw


class _DuplicateKey(yaml.constructor.ConstructorError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (merge keys `<<` aside)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # unhashable: SafeLoader reports it below
                continue
            if duplicate:
                raise _DuplicateKey(
                    "while constructing a mapping", node.start_mark, f"duplicate key {show(key)}",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def parse_yaml(text: str) -> Any:
    """`yaml.safe_load` refusing duplicate keys."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def check_expansion(data: Any, where: str) -> None:
    """Refuses `data` if walking it (aliases expanded) would visit too much; stops at the bound."""
    stack, values, chars = [data], 0, 0
    while stack:
        x = stack.pop()
        values += 1
        if isinstance(x, str):
            chars += len(x)
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        if values > MAX_VALUES or chars > MAX_TEXT:
            raise ConfigError(f"{where}: expands to more than {MAX_VALUES} values or {MAX_TEXT} characters "
                              "(YAML aliases?); a config is a few hundred values")


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {show(item)} is not of the form section.key=value")
    try:
        value = parse_yaml(text) if text.strip() else ""
    except _DuplicateKey as e:
        raise ConfigError(f"{_name(key)}: {e.problem} in {show(text)}") from None
    except (yaml.YAMLError, ValueError, RecursionError):  # not YAML: the text itself (ValueError: a huge int)
        value = text
    node = raw
    *parents, leaf = key.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{_name(key)}: {_name(part)} is not a section")
        node = child
    node[leaf] = value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted((k for k in raw if k not in fields), key=str)
    if unknown:
        raise ConfigError(f"unknown key {prefix}{_name(unknown[0])} (known: {', '.join(sorted(fields))})")
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
            raise ConfigError(f"{key}: {show(value)} is not one of {', '.join(map(str, choices))}")
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
            try:
                return float(value)
            except OverflowError:  # an int beyond float range
                raise ConfigError(f"{key}: {show(value)} is too large for a float") from None
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    else:  # pragma: no cover - a field type this parser does not know is a bug here
        raise TypeError(f"unsupported config type {tp} for {key}")
    raise ConfigError(f"{key}: expected {tp.__name__}, got {type(value).__name__} {show(value)}")


# ----------------------------------------------------------------------------------
# Validation: impossible values and rate-limiter settings that would deadlock.


def _require(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why}")


@dataclass(frozen=True)
class Interval:
    """The values a number may take: `lo <= x <= hi`, with either end open or infinite."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, x: float) -> bool:
        above = x > self.lo if self.lo_open else x >= self.lo
        below = x < self.hi if self.hi_open else x <= self.hi
        return above and below

    def __str__(self) -> str:
        lo, hi = _number(self.lo), _number(self.hi)
        if self.hi == math.inf:
            return f"{'>' if self.lo_open else '>='} {lo}"
        if self.lo == -math.inf:
            return f"{'<' if self.hi_open else '<='} {hi}"
        return f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


POSITIVE = Interval(0, lo_open=True)
NON_NEGATIVE = Interval(0)
# Timeouts reach native calls (Reverb, gRPC, JAX's coordination service) as int32 milliseconds.
TIMEOUT = Interval(0, (2**31 - 1) // 1000, lo_open=True)
# Integers reach XLA (32-bit without x64) and Reverb's int32 arguments: every int field fits in 32 bits.
INT32 = Interval(-(2**31), 2**31 - 1)

# The range of each number field that has one (checked after the generic type rules of
# `_check_numbers`); cross-field rules are in `validate` and its helpers below.
RANGES: dict[str, Interval] = {
    "model.vocab_size": POSITIVE, "model.d_model": POSITIVE, "model.n_layers": POSITIVE,
    "model.n_heads": POSITIVE, "model.n_kv_heads": POSITIVE, "model.head_dim": POSITIVE, "model.d_ff": POSITIVE,
    "model.max_seq_len": POSITIVE, "model.rope_theta": POSITIVE, "model.rope_scaling_factor": Interval(1),
    "model.rope_low_freq_factor": POSITIVE, "model.rope_high_freq_factor": POSITIVE,
    "model.rope_original_max_len": POSITIVE, "model.norm_eps": POSITIVE,
    "task.eval_size": POSITIVE, "task.data_seed": NON_NEGATIVE,
    "warmstart.steps": NON_NEGATIVE, "warmstart.batch_size": POSITIVE, "warmstart.learning_rate": POSITIVE,
    "warmstart.teacher_carry_error": Interval(0, 1),
    # Below ~1e-3, logits / temperature overflow float32 and sampling turns to NaN.
    "sampling.temperature": Interval(1e-3), "sampling.top_p": Interval(0, 1, lo_open=True),
    "sampling.top_k": NON_NEGATIVE, "sampling.max_new_tokens": POSITIVE, "sampling.prefill_chunk_size": NON_NEGATIVE,
    "sampling.engine_slots": NON_NEGATIVE, "sampling.engine_chunk_steps": POSITIVE,
    # Past ~100, priority ** exponent underflows float64 for the 1e-3 priority floor (replay.writer).
    "replay.priority_exponent": Interval(0, 100), "replay.max_size": POSITIVE,
    "replay.max_times_sampled": NON_NEGATIVE, "replay.samples_per_insert": POSITIVE,
    "replay.min_size_to_sample": POSITIVE, "replay.error_buffer": Interval(1),
    "replay.positive_fraction": Interval(0, 1, hi_open=True), "replay.calibrate_steps": NON_NEGATIVE,
    "replay.max_age": NON_NEGATIVE, "replay.fresh_fraction": Interval(0, 1, hi_open=True),
    "replay.priority_decay": Interval(0, 1, lo_open=True),
    "replay.cost_rho": POSITIVE, "replay.timeout_s": TIMEOUT, "replay.port": Interval(0, 65535),
    "train.steps": POSITIVE, "train.max_generated_tokens": NON_NEGATIVE, "train.eval_every_tokens": NON_NEGATIVE, "train.batch_size": POSITIVE, "train.prompts_per_step": POSITIVE,
    "train.group_size": Interval(2), "train.learning_rate": POSITIVE, "train.warmup_steps": NON_NEGATIVE,
    "train.weight_decay": NON_NEGATIVE, "train.adam_b1": Interval(0, 1, hi_open=True),
    "train.adam_b2": Interval(0, 1, hi_open=True), "train.grad_clip": POSITIVE,
    "train.max_nonfinite_steps": POSITIVE, "train.eps_low": Interval(0, 1, hi_open=True),
    "train.eps_high": NON_NEGATIVE, "train.kl_coef": NON_NEGATIVE, "train.eval_every": POSITIVE,
    "train.weight_sync_every": POSITIVE, "train.tis_cap": POSITIVE, "train.micro_batch_size": NON_NEGATIVE,
    "train.logits_chunk_size": NON_NEGATIVE,
    "checkpoint.every": POSITIVE, "checkpoint.every_seconds": NON_NEGATIVE, "checkpoint.keep": POSITIVE,
    "mesh.actor_devices": NON_NEGATIVE, "mesh.actor_tensor": POSITIVE,  # data/fsdp/tensor: _validate_mesh
    "distributed.num_processes": NON_NEGATIVE, "distributed.process_id": Interval(-1),
    "distributed.timeout_s": TIMEOUT, "distributed.heartbeat_timeout_s": TIMEOUT,
    "run.seed": NON_NEGATIVE, "run.lease_s": TIMEOUT,
}

# The modules that own config keys and check them themselves (`owner_check`), in the order their checks
# run. `validate` imports them when it first runs, so importing this module pulls in no higher stage.
OWNERS = (
    "jaxreplay.models.architectures",
    "jaxreplay.replay.limiter",
    "jaxreplay.tasks.registry",
    "jaxreplay.tools.topology",
    "jaxreplay.replay.tables",
    "jaxreplay.replay.server",
    "jaxreplay.replay.writer",
    "jaxreplay.replay.multiprocess",
    "jaxreplay.rollout.actor",
)
_OWNER_CHECKS: dict[str, Callable[[Config], None]] = {}


def owner_check(check: Callable[[Config], None]) -> Callable[[Config], None]:
    """Registers `check(config)` to run at the end of `validate`. A module that owns keys checks
    them itself and registers here, so this module imports no owner; it must be one of `OWNERS`."""
    if check.__module__ not in OWNERS:
        raise RuntimeError(f"{check.__module__} registers a config check but is not in config.OWNERS")
    _OWNER_CHECKS[f"{check.__module__}.{check.__qualname__}"] = check
    return check


def _owner_checks() -> list[Callable[[Config], None]]:
    for module in OWNERS:
        importlib.import_module(module)
    return sorted(_OWNER_CHECKS.values(), key=lambda check: OWNERS.index(check.__module__))


def validate(c: Config, local: bool = True) -> None:
    """Every rule on `c`: number types and ranges, then cross-field rules, then the owners' checks;
    with `local`, also that this machine can run `c` (`_validate_machine`)."""
    _check_numbers(c)
    m, t = c.model, c.train
    _require(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
             f"must divide model.n_heads ({m.n_heads}), got {m.n_kv_heads}")
    _require(m.head_dim % 2 == 0, "model.head_dim", f"must be even for RoPE, got {m.head_dim}")
    _require(m.rope_low_freq_factor < m.rope_high_freq_factor, "model.rope_high_freq_factor",
             f"must exceed model.rope_low_freq_factor ({m.rope_low_freq_factor})")
    _require(t.loss != "asymre" or t.advantage != "group_normalized", "train.advantage",
             "AsymRE needs r - V: use group_centered or leave_one_out, not group_normalized")
    _require(t.micro_batch_size == 0 or t.batch_size % t.micro_batch_size == 0, "train.micro_batch_size",
             f"{t.micro_batch_size} does not divide train.batch_size={t.batch_size}")
    _require(c.run.dir != "", "run.dir", "must not be empty")
    _validate_replay(c)
    _validate_mesh(c)
    _validate_distributed(c)
    _validate_locations(c)
    _validate_wandb(c)
    for check in _owner_checks():
        check(c)
    if local:
        _validate_machine(c)


def _validate_locations(c: Config) -> None:
    """Paths that may be bucket URLs name a scheme the storage layer reads (storage.py)."""
    for key, value in (("run.dir", c.run.dir), ("warmstart.cache_dir", c.warmstart.cache_dir),
                       ("model.hf_path", c.model.hf_path), ("task.path", c.task.path)):
        if value is not None:
            try:
                storage.check(value, key)
            except storage.StorageError as e:
                raise ConfigError(str(e)) from None


def _validate_machine(c: Config) -> None:
    """What this machine must have to run `c`: Reverb installed, the model directory on disk or in a bucket."""
    _require(c.replay.backend != "reverb" or importlib.util.find_spec("reverb") is not None, "replay.backend",
             "reverb is not installed (pip install 'jaxreplay[reverb]', Python 3.10/3.11), or use inprocess")
    for key, value in (("run.dir", c.run.dir), ("warmstart.cache_dir", c.warmstart.cache_dir)):
        # With TensorFlow installed (the Reverb lane), Orbax reaches buckets through tf.io.gfile, untested here.
        _require(not storage.is_url(value) or importlib.util.find_spec("tensorflow") is None, key,
                 f"{value}: run dirs and caches in buckets need the default tier (Python >= 3.12, no TensorFlow); "
                 "the Reverb lane writes them to a disk")
    _require(c.wandb.mode == "disabled" or importlib.util.find_spec("wandb") is not None, "wandb.mode",
             f"{c.wandb.mode} needs wandb (pip install 'jaxreplay[tracking]'), or use disabled")
    hf_path = c.model.hf_path
    config_json = None if hf_path is None else storage.join(hf_path, "config.json")
    _require(hf_path is None or (storage.exists(config_json) if storage.is_url(hf_path) else Path(config_json).is_file()),
             "model.hf_path", f"{show(hf_path)} is not a Hugging Face model directory (no config.json)")


def _check_numbers(c: Config) -> None:
    """By field type, every float is finite and every int fits in 32 bits; then `RANGES`."""
    for section in dataclasses.fields(c):
        value = getattr(c, section.name)
        hints = typing.get_type_hints(type(value))
        for f in dataclasses.fields(value):
            key, x, tp = f"{section.name}.{f.name}", getattr(value, f.name), hints[f.name]
            if x is None or isinstance(x, bool):
                continue
            if _is(tp, float):
                _require(math.isfinite(x), key, f"must be a finite number, got {x}")
            elif _is(tp, int):
                _require(x in INT32, key, f"{x} does not fit in 32 bits (must be {INT32})")
            if key in RANGES:
                _require(x in RANGES[key], key, f"must be {RANGES[key]}, got {show(x)}")


def _is(tp: Any, kind: type) -> bool:
    """`tp` is `kind` or Optional[`kind`]."""
    return tp is kind or kind in typing.get_args(tp) and set(typing.get_args(tp)) <= {kind, type(None)}


def _validate_replay(c: Config) -> None:
    """Rejects limiter settings the table cannot honour (the deadlock window: replay/limiter.py)."""
    r, t = c.replay, c.train
    b = t.batch_size
    if r.mode == "on_policy":
        return  # the queue is sized from the batch: see replay.tables
    spi = r.samples_per_insert
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
    # That the window holds one batch plus one insert is the limiter's rule (replay.limiter.check_window).


def _validate_mesh(c: Config) -> None:
    """Shapes alone; the fit to the machine's devices is checked by `sharding.make_mesh`."""
    m = c.mesh
    sizes = {"mesh.data": m.data, "mesh.fsdp": m.fsdp, "mesh.tensor": m.tensor}
    for key, value in sizes.items():
        _require(value > 0 or value == -1, key, f"must be positive or -1 (the rest), got {value}")
    rest = [k for k, v in sizes.items() if v == -1]
    _require(len(rest) <= 1, rest[-1] if rest else "mesh", f"only one mesh size may be -1, got {', '.join(rest)}")
    if m.actor_devices:
        _require(m.actor_devices % m.actor_tensor == 0, "mesh.actor_tensor",
                 f"{m.actor_tensor} does not divide mesh.actor_devices={m.actor_devices}")


def _validate_wandb(c: Config) -> None:
    """Names W&B would refuse only once the run is under way (project and entity: no / \\ # ? % :)."""
    for key, value in (("wandb.project", c.wandb.project), ("wandb.entity", c.wandb.entity)):
        _require(value is None or (value.strip() != "" and not set(value) & set("/\\#?%:")), key,
                 f"{show(value)} is not a W&B {key.split('.')[1]} name (not empty, none of / \\ # ? % :)")


def _validate_distributed(c: Config) -> None:
    d = c.distributed
    _require(d.num_processes == 0 or d.process_id < d.num_processes, "distributed.process_id",
             f"{d.process_id} is not below distributed.num_processes={d.num_processes}")
    for key, address in [("distributed.coordinator_address", d.coordinator_address),
                         ("distributed.replay_address", d.replay_address),
                         ("distributed.coordinator_bind_address", d.coordinator_bind_address)]:
        host, sep, port = address.rpartition(":")
        _require(not address or (sep and host and port.isdigit() and 0 < int(port) < 65536), key,
                 f"{show(address)} is not of the form host:port")
    files = {f"distributed.{k}": getattr(d, k) for k in ("mtls_cert_file", "mtls_key_file", "mtls_ca_file")}
    missing = [k for k, v in files.items() if not v]
    _require(len(missing) in (0, len(files)), missing[0] if missing else "",
             f"mutual TLS needs {', '.join(files)} together: set it too, or none of them")
    _require(not d.mtls_peer_uri_prefix or len(missing) == 0, "distributed.mtls_peer_uri_prefix",
             f"needs {', '.join(files)}")
    _require(not d.mtls_peer_uri_prefix or d.mtls_peer_uri_prefix.endswith("/"), "distributed.mtls_peer_uri_prefix",
             f"{show(d.mtls_peer_uri_prefix)} must end with '/' (else 'spiffe://example.org.evil/' matches "
             f"'spiffe://example.org')")
