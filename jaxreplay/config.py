"""Typed run configuration: YAML file + dotted overrides, validated once at the edge.

Every section is a frozen dataclass. `load_config` is the only way in: it rejects
unknown keys, wrong types and impossible values (including rate-limiter settings
that would deadlock) with a `ConfigError` whose one-line message names the key.
Number fields are checked by type (floats finite, ints within 32 bits) and against
`RANGES`; the modules in `OWNERS` check their own keys (`owner_check`).
"""

from __future__ import annotations

import dataclasses
import difflib
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

    kind = "config error"  # the word the command's one error line names it by (`jaxreplay.error_line`)


Selector = Literal["uniform", "fifo", "lifo", "prioritized"]
DType = Literal["float32", "bfloat16", "float16"]


# The modules LoRA can adapt, by the model's own names (jaxreplay/models/transformer.py)
LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_TARGETS: tuple[str, ...] = typing.get_args(LoraTarget)


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on a frozen base (jaxreplay/models/lora.py); off while `targets` is empty."""

    # the modules that get adapters, of q_proj k_proj v_proj o_proj gate_proj up_proj down_proj (every layer's);
    # empty: no LoRA, every weight trains
    targets: tuple[LoraTarget, ...] = ()
    # the adapters' rank r: each adapted kernel [in, out] gains A [in, r] and B [r, out]
    rank: int = 8
    # the adapters' output is scaled by alpha / rank, as in PEFT (no rsLoRA)
    alpha: float = 16.0


@dataclass(frozen=True)
class ModelConfig:
    """A Llama/Qwen2/Qwen3/Gemma 2/Gemma 3-family decoder."""

    # embedding rows (≥ the tokenizer's vocabulary)
    vocab_size: int = 32
    # residual width
    d_model: int = 128
    # decoder blocks
    n_layers: int = 2
    # query heads
    n_heads: int = 4
    # key/value heads (grouped-query attention; divides `n_heads`)
    n_kv_heads: int = 2
    # per-head width (even, for RoPE)
    head_dim: int = 32
    # SwiGLU hidden width
    d_ff: int = 384
    # longest prompt + completion
    max_seq_len: int = 16
    # RoPE base
    rope_theta: float = 10_000.0
    # Llama 3.1+ RoPE scaling (HF `rope_type: llama3`): wavelengths above `rope_original_max_len` /
    # `rope_low_freq_factor` are slowed by this factor, those below `rope_original_max_len` /
    # `rope_high_freq_factor` kept, those between interpolated; 1 = plain RoPE. With `rope_scaling_type: linear`
    # every frequency is divided by it (HF `rope_type: linear`, Gemma 3's global layers)
    rope_scaling_factor: float = 1.0
    # how `rope_scaling_factor` scales the (global layers') RoPE: `llama3` or `linear`
    rope_scaling_type: Literal["llama3", "linear"] = "llama3"
    # Llama 3.1+ RoPE scaling: wavelengths above `rope_original_max_len` / this are slowed by `rope_scaling_factor`
    rope_low_freq_factor: float = 1.0
    # Llama 3.1+ RoPE scaling: wavelengths below `rope_original_max_len` / this are kept
    rope_high_freq_factor: float = 4.0
    # Llama 3.1+ RoPE scaling: the context length the model was pretrained at
    rope_original_max_len: int = 8192
    # RMSNorm epsilon
    norm_eps: float = 1e-6
    # share input embedding and output head
    tie_embeddings: bool = True
    # bias on q/k/v projections (Qwen2)
    attention_bias: bool = False
    # RMSNorm on queries and keys (Qwen3, Gemma 3)
    qk_norm: bool = False
    # mixture of experts (Qwen3-MoE): routed experts in each sparse layer's MLP (0: every layer has the dense
    # SwiGLU MLP of width `d_ff`; jaxreplay/models/moe.py)
    n_experts: int = 0
    # experts each token is routed to: the top k of the router's softmax (HF `num_experts_per_tok`)
    experts_per_token: int = 1
    # each expert's SwiGLU hidden width (HF `moe_intermediate_size`)
    moe_d_ff: int = 64
    # renormalise each token's top-k router probabilities to sum to 1 (HF `norm_topk_prob`)
    moe_norm_topk: bool = True
    # with experts, layer i is sparse iff (i + 1) is a multiple of this (HF `decoder_sparse_step`)
    moe_sparse_step: int = 1
    # layers that keep the dense MLP among sparse ones (HF `mlp_only_layers`)
    moe_dense_layers: tuple[int, ...] = ()
    # how tokens reach their experts, both dropless (no capacity, no token dropped): `ragged_dot` sorts the
    # (token, expert) pairs by expert and runs one grouped matmul (compute grows with tokens * k); `dense` runs
    # every expert on every token and weights the unchosen by 0 (E / k times the FLOPs; faster on CPU at demo
    # sizes, docs/hf.md); a run setting, kept over `model.hf_path`'s architecture
    moe_dispatch: Literal["ragged_dot", "dense"] = "ragged_dot"
    # weight of the routers' load-balancing loss in the learner's loss (HF `router_aux_loss_coef`, as
    # `load_balancing_loss_func` computes it over every sparse layer and real token; `router_aux_loss`)
    router_aux_loss_coef: float = 0.0
    # the MLP's gate activation: `silu` (SwiGLU: Llama, Qwen) or `gelu_tanh` (GeGLU with tanh-approximated GELU:
    # Gemma's `gelu_pytorch_tanh`)
    mlp_activation: Literal["silu", "gelu_tanh"] = "silu"
    # RMSNorm scales by (1 + scale), its scale initialised to 0 (Gemma)
    norm_plus_one: bool = False
    # Gemma's four norms per block: the attention's and the MLP's outputs are normed too, before each joins the
    # residual stream
    post_norms: bool = False
    # multiply the token embeddings by sqrt(d_model), in the compute dtype (Gemma)
    scale_embeddings: bool = False
    # attention scores are scaled by this ** -0.5 (Gemma's `query_pre_attn_scalar`); null: `head_dim`
    query_pre_attn_scalar: Optional[int] = None
    # attention scores pass through cap * tanh(score / cap) before the mask (Gemma 2); null: no cap
    attn_logit_softcap: Optional[float] = None
    # final logits pass through cap * tanh(logit / cap) (Gemma 2); null: no cap
    final_logit_softcap: Optional[float] = None
    # local (sliding-window) layers see the last this many tokens, their own included; null: every layer is global
    sliding_window: Optional[int] = None
    # with `sliding_window`, layer i (from 0) is global when (i + 1) is a multiple of this and local otherwise
    # (Gemma 2: 2, Gemma 3: 6); 1: every layer global
    sliding_window_pattern: int = 1
    # the RoPE base of the local layers, never scaled (Gemma 3's `rope_local_base_freq`); null: `rope_theta`
    rope_local_theta: Optional[float] = None
    # dtype of the parameters: float32, bfloat16 or float16
    param_dtype: DType = "float32"
    # dtype of activations and matmuls: float32, bfloat16 or float16
    compute_dtype: DType = "float32"
    # a local Hugging Face model directory (Llama, Qwen2, Qwen3, Gemma 2 or Gemma 3 text; config.json, safetensors,
    # tokenizer), or a gs:// URL: the architecture comes from its config.json (every `model.*` key above except
    # `max_seq_len` and the dtypes is ignored) and the initial weights from its safetensors
    hf_path: Optional[str] = None
    # the architecture alone, for `jaxreplay compile` when `model.hf_path` is not given: a directory holding a
    # config.json, or a shipped one: `qwen2.5-0.5b`, `qwen2.5-1.5b`, `qwen2.5-3b`, `qwen2.5-7b`, `qwen3-0.6b`,
    # `gemma3-1b`, `gemma3-4b` (jaxreplay/models/architectures)
    hf_config: Optional[str] = None
    # LoRA: train low-rank adapters on these modules and freeze the rest (docs/lora.md)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass(frozen=True)
class TaskConfig:
    """The prompt source and its reward.

    "arithmetic": the embedded `a+b=` task with an exact-match reward (the digit keys).
    "gsm8k", "math": local files at `path` (e.g. the Hub repository's Parquet shards), or
    without `path` TFDS datasets read from `data_dir` (never downloaded; needs TensorFlow).
    "jsonl", "parquet": local files of any dataset at `path`.
    "reasoning_gym": one of reasoning-gym's procedural generators (`dataset`, `dataset_config`;
    the reasoning_gym extra), its three splits drawn from seeds far apart (tasks/procedural.py).
    `path`: a pattern with `{split}` for the split name (glob wildcards allowed) or a
    directory in a Hub dataset's layout; the file extension gives the format.
    Dataset keys left null take the source's defaults (tasks.datasets.SOURCES).
    """

    # `arithmetic` (the embedded task), `gsm8k` or `math` (local files in `task.path`, else TFDS), `jsonl` or
    # `parquet` (local files), `reasoning_gym` (a reasoning-gym generator: `task.dataset`; the reasoning_gym extra),
    # `guess_digit` (the multi-turn demo's hidden digits: needs `environment.name: guess_digit`), `guess_number` (the
    # multi-turn testbed's hidden numbers in a range: needs `environment.name: guess_number`)
    name: Literal["arithmetic", "gsm8k", "math", "jsonl", "parquet", "reasoning_gym", "guess_digit",
                  "guess_number"] = "arithmetic"
    # reasoning_gym: the generator's name (`products`, `chain_sum`, `gcd`, `base_conversion`, `number_sorting`, ...);
    # null for the other tasks
    dataset: Optional[str] = None
    # reasoning_gym: the generator's settings, its config class's keyword arguments (`task.dataset_config.min_digits=3`
    # or `task.dataset_config={min_digits: 3, max_digits: 3}`); its seed and size come from `task.data_seed` and the
    # split sizes
    dataset_config: dict[str, Any] = field(default_factory=dict)
    # smallest operand size in digits (arithmetic)
    min_digits: int = 2
    # largest operand size in digits; operands are zero-padded to it (arithmetic)
    max_digits: int = 2
    # any of `+`, `-`, `*`
    operations: tuple[str, ...] = ("+",)
    # write answers least significant digit first: the order in which carries flow
    reverse_answer: bool = True
    # arithmetic, `+` or `*` alone: the completion first works the problem, then `:` and the answer; the reward reads
    # the answer after the last `:`, the warm start teaches the format. A sum works every column, least significant
    # first (`a+b+carry=two-digit sum`, comma-separated; its sloppy teacher writes every carry in as 0): 10·w + 2
    # tokens for w = max_digits. A product writes, for each digit d of b, `d*P=S` with a·d and the running sum of
    # the shifted partial products, reversed and zero-padded (its sloppy teacher drops each digit product's carry):
    # w·(3w + 5) + 2w + 1 tokens. `sampling.max_new_tokens` must hold them
    scratchpad: bool = False
    # held-out problems of the test split (`eval/accuracy`, `jaxreplay eval`), never drawn for training: every
    # reported number comes from it
    eval_size: int = 256
    # problems of a validation split, disjoint from the test split and never drawn for training, scored at every
    # evaluation beside it (`eval/validation_accuracy`): what learning rates are chosen on (0 = none). Datasets take
    # it from the end of the training split, reasoning_gym draws it from a seed of its own
    validation_size: int = 0
    # a finite training pool of this many problems, visited in epochs in a seeded order, so prompts repeat as they
    # do in GSM8K or MATH (0 = arithmetic draws fresh problems forever, reasoning_gym pools 2048, datasets use their
    # whole training split). The pool is fixed by task.data_seed, its order by run.seed
    train_size: int = 0
    # how the arithmetic task makes its splits. `fixed`: test, validation, the warm start's own split
    # (`task.warmstart_size`) and the training pool are dealt in that order from one seeded shuffle of distinct
    # problems that no split size changes, so `task.train_size` moves neither the held-out splits nor the warm start,
    # and a smaller pool is the first problems of a larger one. `dealt`: the layout before issue 49, pinned by the
    # committed sweep files: test, validation and pool dealt from one draw of their summed sizes (`task.train_size`
    # moves the held-out splits), and the warm start draws from the training pool or stream
    splits: Literal["dealt", "fixed"] = "dealt"
    # arithmetic with `task.splits=fixed`: problems of the warm start's own split, disjoint from the test, validation
    # and training splits, visited in epochs by the warm start's demonstrations
    warmstart_size: int = 2000
    # seed of the test and validation splits and of the training pool (reasoning_gym: the three splits draw from
    # seeds 2^28 apart, as its item i is drawn with Random(seed + i))
    data_seed: int = 1234
    # local files: a pattern with `{split}` for the split name ending in `.parquet` or `.jsonl` (glob wildcards
    # allowed: `data/{split}-*.parquet`), or a directory in a Hub dataset's layout (`data/{split}-*.parquet`,
    # `{split}-*.parquet`, `{split}.jsonl`; a config's directory `{config}/`); required for jsonl/parquet
    path: Optional[str] = None
    # gsm8k/math without `task.path`: the TFDS `data_dir` holding the prepared dataset (null: TFDS's default);
    # nothing is downloaded
    data_dir: Optional[str] = None
    # gsm8k/math without `task.path`: TFDS dataset name (null: `gsm8k`; `hendrycks_math` for MATH, which TFDS has no
    # builder for: prepare it under that name)
    tfds_name: Optional[str] = None
    # dataset split of the training stream
    train_split: str = "train"
    # dataset split of the held-out eval set
    eval_split: str = "test"
    # record field holding the prompt (null: gsm8k `question`, math `problem`, files `prompt`)
    prompt_field: Optional[str] = None
    # record field holding the answer (null: gsm8k `answer`, math `solution`, files `answer`)
    answer_field: Optional[str] = None
    # reward by name: `math_equivalence` (last `\boxed{}`), `gsm8k` (`#### n`, box or last number), `exact_match`;
    # null: gsm8k for gsm8k, else math_equivalence; must be null for arithmetic
    reward: Optional[str] = None
    # prompt text; `{prompt}` is replaced by the record's prompt
    prompt_template: str = "{prompt}"
    # wrap the prompt in the tokenizer's chat template (needs `model.hf_path`)
    chat_template: bool = False
    # dataset prompts are left-padded to this many tokens
    max_prompt_len: int = 256
    # a longer prompt is `skip`ped (counted and logged) or an `error`
    long_prompts: Literal["skip", "error"] = "skip"


@dataclass(frozen=True)
class WarmStartConfig:
    """Supervised warm start on a sloppy teacher's demonstrations, cached by the settings that
    produce it (warmstart.py), so the runs of a sweep share one.

    The teacher forgets its carries with probability `teacher_carry_error`, so the
    warm-started policy prefers the carry-free slip: low but non-zero accuracy, and a
    systematic error that RL with an exact-match reward can find and fix.
    """

    # supervised warm-start steps (0 = none)
    steps: int = 800
    # examples per warm-start step
    batch_size: int = 64
    # Adam learning rate of the warm start
    learning_rate: float = 1e-3
    # share of demonstrations that forget their carries
    teacher_carry_error: float = 0.75
    # where warm starts are cached, each under a hash of the settings that produce it (model, task, `warmstart.*`,
    # `run.seed`, `sampling.max_new_tokens`, JAX version); "": `.warmstart-cache` beside `run.dir`; `jaxreplay
    # sweep` sets OUT/.warmstart-cache, so every setting of a seed shares one
    cache_dir: str = ""


@dataclass(frozen=True)
class SamplingConfig:
    """Rollout sampling; the learner scores with the same temperature."""

    # rollout temperature (the learner scores with the same)
    temperature: float = 1.0
    # nucleus sampling
    top_p: float = 1.0
    # top-k sampling (0 = off)
    top_k: int = 0
    # completion length cap
    max_new_tokens: int = 5
    # dtype of the KV cache (float32, bfloat16, float16); null: `model.compute_dtype`
    kv_cache_dtype: Optional[DType] = None
    # prompt tokens prefilled per model call (0: the whole prompt at once); long prompts need less memory
    prefill_chunk_size: int = 0
    # How the actor generates: "static" decodes each prompt batch in one call; "continuous" streams prompt
    # groups through the rollout engine's slot pool, each group entering the table as it completes.
    engine: Literal["static", "continuous"] = "static"
    # continuous: decode slots in the engine's pool (0: train.prompts_per_step * train.group_size per process).
    engine_slots: int = 0
    # continuous: decode steps per jitted chunk; between chunks the host refills slots, hands completed
    # groups to the table and sees stop signals.
    engine_chunk_steps: int = 8


@dataclass(frozen=True)
class EnvironmentConfig:
    """Multi-turn episodes (docs/multiturn.md): an environment answers each model turn.

    The task's items are the episodes' `reset(item, seed)`; the G rows of a group are G instances
    reset alike. Needs `sampling.engine: continuous`; `sampling.max_new_tokens` bounds an episode's
    model and environment tokens together. Off (single-turn) while `name` is empty.
    """

    # a registered environment (`guess_digit`), `package.module:factory` of your own, or `agent_loop`: episodes an
    # outside agent loop plays through an endpoint the run serves (docs/serving.md); "" = single-turn rows
    name: str = ""
    # keyword arguments of the environment's factory
    options: dict[str, Any] = field(default_factory=dict)
    # model turns per episode; an episode still going after them is truncated
    max_turns: int = 4
    # the episode's reward: `final` (the last step's) or `sum` (over its steps)
    reward: Literal["final", "sum"] = "final"
    # environment workers running steps off the decode loop (0: each step at once in the actor's thread, no timeout:
    # for deterministic zero-latency environments)
    workers: int = 4
    # run the workers as processes, killed and restarted when a step times out (for environments that may block
    # forever; a thread cannot be killed). The environment must be importable by name in a fresh process
    processes: bool = False
    # seconds a reset or step may take; past it the episode ends with info error `timeout` (counted)
    step_timeout_s: float = 30.0
    # evaluation episodes in flight at once: the evaluation engine's slots, and (with thread workers) at least as many
    # workers for its steps; more finish an evaluation sooner where steps take time, at more cache memory
    eval_slots: int = 64


@dataclass(frozen=True)
class ReplayConfig:
    """The Reverb table between actor and learner.

    mode "replay": selector over a FIFO window of `max_size` rollouts, rate-limited to
    `samples_per_insert`. mode "on_policy": the baseline queue, each rollout trained
    on exactly once, freshest first (selector/max_size/ratio settings are ignored).
    """

    # `replay`, or `on_policy`: the baseline queue, each rollout trained on once, freshest first
    mode: Literal["replay", "on_policy"] = "replay"
    # uniform, fifo, lifo or prioritized
    selector: Selector = "uniform"
    # exponent of the prioritized selector; priorities are |advantage| + 0.001, fixed at insertion
    priority_exponent: float = 1.0
    # N: the FIFO window of freshest rollouts
    max_size: int = 512
    # remove an item after this many samples (0 = never). In replay mode the loop then assembles each batch over
    # several turns from what can be sampled without blocking, which cannot deadlock; the measured ratio cannot
    # exceed it, whatever `samples_per_insert` says. Not with `positive_fraction`
    max_times_sampled: int = 0
    # target replay ratio
    samples_per_insert: float = 2.0
    # inserts before the first sample
    min_size_to_sample: int = 128
    # limiter tolerance; null = `train.batch_size + samples_per_insert`; must be ≥ (batch + spi) / 2
    error_buffer: Optional[float] = None
    # d: positive-bias sampling (replay mode). A second table keeps the freshest dN rollouts with reward > 0 beside
    # the freshest (1−d)N of all; each batch takes round(dB) rows from it (all from the main table until a correct
    # rollout exists); the main limiter runs at spi·(1−d) so each rollout is still trained on `samples_per_insert`
    # times on average
    positive_fraction: float = 0.0
    # K > 0: never sample, and evict, rollouts more than K policy versions behind the learner (in-process backend,
    # single process; see "Replay knobs" in the docs)
    max_age: int = 0
    # f: round(fB) rows of every batch from a table of the last R rollouts inserted (the newest actor step's); the
    # main limiter runs at spi·B_main/B (replay mode, single process)
    fresh_fraction: float = 0.0
    # prioritized selector: priority = (|advantage| + 0.001) × decay^age, age in policy versions (1: no decay)
    priority_decay: float = 1.0
    # groups whose advantages are all 0 are not inserted (counted in `replay/dropped_groups`; single process)
    drop_zero_advantage_groups: bool = False
    # > 0: after the warm start and before the table is built, time this many generation calls and learner updates
    # (throwaway copies, compiling calls left out), measure mu, and set `samples_per_insert` to the cost model's y =
    # √(mu / (`cost_rho` + R/N)); saved in `RUN_DIR/calibration.json` and reused on resume (Reverb fixes the limiter
    # when the table is built)
    calibrate_steps: int = 0
    # rho of the cost model (see `jaxreplay theory`) used by calibration
    cost_rho: float = 0.1
    # every blocking replay call ends with a clear error after this (its waits run in 0.1 s slices, so SIGTERM acts
    # during them)
    timeout_s: float = 60.0
    # Reverb server port (0 = a free one). Reverb listens on all interfaces (it takes no bind address); a port
    # another run or program holds is refused before anything starts
    port: int = 0
    # `reverb` (a Reverb server; multi-host: one on process 0), `inprocess` (the same table semantics in this
    # process, no Reverb/TensorFlow: Python 3.12, Colab; multi-host: one shard per process), or `auto`: reverb where
    # it is installed, else inprocess. Where Reverb is not importable (Python 3.12+), `reverb` runs it in a sidecar
    # process under a Python 3.11 that has it (`make venv-sidecar`; see `reverb_python`)
    backend: Literal["auto", "reverb", "inprocess"] = "auto"
    # the Python 3.10/3.11 interpreter (with dm-reverb, TensorFlow 2.15, PyYAML) that runs Reverb's sidecar where
    # Reverb is not importable here; "": the checkout's `.venv-sidecar` (`make venv-sidecar`) or `.venv-reverb`,
    # else a Python 3.11 found as the Makefile finds one
    reverb_python: str = ""


@dataclass(frozen=True)
class TrainConfig:
    """Learner and actor shapes and the GRPO/PPO update."""

    # learner steps
    steps: int = 300
    # also stop at the first learner step once the actor has generated this many completion tokens (0: off):
    # settings compared at one inference budget; `summary.json` says which rule stopped the run (`stopped_by`). A
    # float, so budgets past 2**31 tokens can be written (2e9)
    max_generated_tokens: float = 0.0
    # also evaluate after the first learner step past each multiple of this many generated tokens (0: off)
    eval_every_tokens: float = 0.0
    # rollouts per learner step (B)
    batch_size: int = 64
    # prompts per actor step
    prompts_per_step: int = 8
    # completions per prompt (G); R = prompts × G rollouts per actor step
    group_size: int = 8
    # AdamW learning rate (constant after warm-up)
    learning_rate: float = 3e-4
    # linear learning-rate warm-up, then constant: a fresh Adam state's first steps are sign-like
    warmup_steps: int = 10
    # AdamW weight decay
    weight_decay: float = 0.0
    # Adam's first-moment decay
    adam_b1: float = 0.9
    # Adam's second-moment decay
    adam_b2: float = 0.99
    # global-norm clipping
    grad_clip: float = 1.0
    # a step with a non-finite loss, gradient or update is skipped (params and optimizer state kept, `nonfinite` = 1
    # in its metrics); this many in a row stop the run without a checkpoint, so the latest one holds the last good
    # params
    max_nonfinite_steps: int = 5
    # PPO clip range below 1 (ratio ≥ 1 - eps_low)
    eps_low: float = 0.2
    # PPO clip range above 1 (ratio ≤ 1 + eps_high)
    eps_high: float = 0.2
    # k3 KL penalty to the warm-start policy (0 = off, as in the paper)
    kl_coef: float = 0.0
    # learner steps between evaluations
    eval_every: int = 20
    # disaggregated mode: learner steps between weight pushes to the actor (k)
    weight_sync_every: int = 1
    # `grpo` (PPO-clipped ratio on the frozen behaviour log-probs), `tis` (truncated importance sampling: gradient
    # min(ratio, `tis_cap`)·A·∇log π), `asymre` (REINFORCE, no ratio, advantage r − (V + dV)); off-policy corrections
    # (docs/comparing.md): `grpo_tis` (token TIS times the PPO clip, verl/SkyRL), `seq_mask` (the paper's loss, rows
    # whose geometric-mean ratio leaves [`seq_mask_low`, `seq_mask_high`] dropped), `m2po` (second-moment token mask),
    # `decoupled` (AReaL's decoupled PPO)
    loss: Literal["grpo", "tis", "asymre", "grpo_tis", "seq_mask", "m2po", "decoupled"] = "grpo"
    # frozen at generation: `group_normalized` (GRPO), `group_centered` (Dr.GRPO, no std), `leave_one_out` (RLOO);
    # `asymre` needs one of the last two
    advantage: Literal["group_normalized", "group_centered", "leave_one_out"] = "group_normalized"
    # `token_mean` (DAPO: every completion token weighs the same), `sequence_mean` (GRPO: per completion, then over
    # the batch), `constant` (Dr.GRPO: token sum / (B · `sampling.max_new_tokens`))
    loss_aggregation: Literal["token_mean", "sequence_mean", "constant"] = "token_mean"
    # ratio cap of `tis` and `grpo_tis` (> 1)
    tis_cap: float = 2.0
    # `seq_mask`: a row whose geometric-mean token ratio π_θ/π_behaviour is below this is dropped from the loss
    seq_mask_low: float = 0.8
    # `seq_mask`: a row whose geometric-mean token ratio is above this is dropped (> `seq_mask_low`)
    seq_mask_high: float = 1.25
    # `m2po`: the tokens of largest squared log-ratio are masked until the batch's mean squared log-ratio is at most
    # this (M2PO's τ)
    m2po_threshold: float = 0.04
    # `decoupled`: a token whose weight π_prox/π_behaviour exceeds this is dropped (AReaL's `behav_imp_weight_cap`;
    # > 1)
    decoupled_weight_cap: float = 5.0
    # dV of `asymre`: the baseline is V + dV (V = group mean)
    asymre_delta_v: float = -0.1
    # rows per forward/backward pass, gradients summed over the batch (0: the whole batch); divides
    # `train.batch_size`, a multiple of the mesh's data parallelism
    micro_batch_size: int = 0
    # per decoder block: `none`, `full` (recompute the block in the backward pass) or `dots` (keep its projections'
    # outputs, recompute the rest)
    remat: Literal["none", "full", "dots"] = "none"
    # a mixture of experts: the learner routes each token to the experts the sampler chose for it (recorded on the
    # row by either sampler), not its router's own top k; off, `router_disagreement` says how often the two differ
    routing_replay: bool = False
    # positions whose logits the learner computes at a time (0: all at once)
    logits_chunk_size: int = 0
    # dtype of Adam's first moment (null: the params'); `bfloat16` saves 2 bytes per parameter (see "Memory and
    # jaxreplay compile" in the docs)
    adam_mu_dtype: Optional[DType] = None


@dataclass(frozen=True)
class CheckpointConfig:
    # learner steps between checkpoints (Orbax + Reverb together)
    every: int = 50
    # also checkpoint after a learner step once this many seconds have passed since the last checkpoint (0: off)
    every_seconds: float = 0.0
    # checkpoints kept (older ones are deleted with the replay checkpoints they name)
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

    # data-parallel size of the (learner's) mesh; one of data, fsdp, tensor may be -1: the rest of the devices
    data: int = 1
    # fully-sharded data-parallel size: parameters and Adam moments sharded over it
    fsdp: int = 1
    # tensor-parallel size (heads, mlp, vocab)
    tensor: int = 1
    # 0: colocated (one mesh samples and trains); > 0: disaggregated, the first this many devices sample, the rest
    # train on the mesh above
    actor_devices: int = 0
    # disaggregated mode: tensor-parallel size of the actor mesh (data parallel over the rest)
    actor_tensor: int = 1
    # the TPU slice the config is sized for (e.g. `v5e-8`); `jaxreplay compile` compiles for it
    topology: Optional[str] = None


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-host SPMD (the driver's multihost placement): every process runs the same program.

    enabled false: one process. Otherwise `jax.distributed.initialize` gets the values
    set here; unset ones ("", 0, -1) are left to JAX's JAX_COORDINATOR_ADDRESS variable
    and cluster auto-detection (TPU pod metadata, SLURM, Open MPI).
    """

    # multi-host SPMD: this process is one of a `jax.distributed` job (the multihost placement,
    # `jaxreplay/train/driver.py`)
    enabled: bool = False
    # host:port of process 0's coordinator; "": JAX_COORDINATOR_ADDRESS or cluster detection (TPU pods)
    coordinator_address: str = ""
    # job size; 0: detected
    num_processes: int = 0
    # this process's index; -1: detected
    process_id: int = -1
    # `replay.backend=reverb`: host:port of the Reverb server on process 0; "": the coordinator's host, the port
    # process 0 publishes
    replay_address: str = ""
    # start-up, barriers and every wait on another process
    timeout_s: float = 300.0
    # a process silent this long counts as dead and fails every other process's waits, so a killed peer stops the
    # job in seconds (JAX's default: 100 s; not settable on the Reverb tier's jax 0.4.34)
    heartbeat_timeout_s: float = 10.0
    # where process 0's coordination service listens; "": `coordinator_address` itself, that interface only (JAX
    # alone listens on every one); `[::]:PORT` for every interface
    coordinator_bind_address: str = ""
    # PEM certificate of this process, for mutual TLS between the coordination service and its clients; the three
    # `mtls_*_file` keys are all set or none (jax 0.12; the Reverb tier's jax 0.4.34 has none, and refuses them)
    mtls_cert_file: str = ""
    # PEM private key for mutual TLS (with `mtls_cert_file` and `mtls_ca_file`)
    mtls_key_file: str = ""
    # PEM certificate authority that signs the peers' certificates, for mutual TLS
    mtls_ca_file: str = ""
    # with mutual TLS: accept a peer whose certificate has a URI SAN starting with this (ends in `/`, e.g.
    # `spiffe://example.org/`) instead of host name verification
    mtls_peer_uri_prefix: str = ""


@dataclass(frozen=True)
class RunConfig:
    # run directory, a local path or a bucket URL (gs://BUCKET/PATH): created if missing, locked while a run uses it
    # (`run.lock`)
    dir: str = "runs/demo"
    # seed of init, prompt stream, sampling and the in-process replay selectors (≥ 0)
    seed: int = 0
    # terminal progress bars (warm start, training and eval)
    progress_bar: bool = True
    # a bucket run dir's lock: renewed every lease_s / 4 seconds; how long a preempted run's lease blocks the resume
    lease_s: float = 60.0


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases tracking (the `tracking` extra; train/tracking.py), beside metrics.jsonl and
    TensorBoard. "offline" writes W&B's run files under RUN_DIR/wandb for `wandb sync` later (TPU
    workers without outbound access); a resume continues the same W&B run (its id in RUN_DIR/wandb.json)."""

    # `offline` or `online`: also log to Weights & Biases (the `tracking` extra); `disabled`: not
    mode: Literal["disabled", "offline", "online"] = "disabled"
    # the W&B project (may not change on resume)
    project: str = "jaxreplay"
    # the W&B entity (null: the account's default; may not change on resume)
    entity: Optional[str] = None
    # the W&B run's display name (null: the run dir's name)
    name: Optional[str] = None


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
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
        raise ConfigError(_unknown_key(cls, prefix, unknown[0]))
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = _coerce(hints[name], value, f"{prefix}{name}")
    return cls(**kwargs)


def config_keys(cls: type = None, prefix: str = "") -> list[str]:
    """Every dotted key a config has (`train.steps`), each section's name (`train`) too."""
    keys = []
    for f in dataclasses.fields(cls or Config):
        tp = typing.get_type_hints(cls or Config)[f.name]
        if dataclasses.is_dataclass(tp):
            keys += [f"{prefix}{f.name}", *config_keys(tp, f"{prefix}{f.name}.")]
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def mapping_keys(cls: type = None, prefix: str = "") -> list[str]:
    """The dotted keys whose values are mappings handed on whole (`task.dataset_config`): `flatten`
    spreads their entries into keys of their own, so a config that drops an entry lacks its key."""
    keys = []
    for f in dataclasses.fields(cls or Config):
        tp = typing.get_type_hints(cls or Config)[f.name]
        if dataclasses.is_dataclass(tp):
            keys += mapping_keys(tp, f"{prefix}{f.name}.")
        elif typing.get_origin(tp) is dict:
            keys.append(f"{prefix}{f.name}")
    return keys


def did_you_mean(name: str, known: typing.Iterable[str]) -> Optional[str]:
    """The known name closest to the unknown `name` (a typo's correction), or None."""
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return match[0] if match else None


def _unknown_key(cls: type, prefix: str, key: Any) -> str:
    """"unknown key train.stepz (did you mean train.steps?)": a key of that name in another section
    (`train.max_size`: replay.max_size), else the closest key of the same section, else the keys
    of the closest name in other sections; with no close one, the section's keys."""
    name, fields = str(key), [f.name for f in dataclasses.fields(cls)]
    settings = [k for k in config_keys() if "." in k]  # not the section names: a key is not a section

    def named(leaf: Optional[str]) -> list[str]:
        return [k for k in settings if k.rsplit(".", 1)[-1] == leaf]

    guess = did_you_mean(name, fields)
    guesses = named(name) or ([f"{prefix}{guess}"] if guess else named(
        did_you_mean(name, {k.rsplit(".", 1)[-1] for k in settings})))
    where = f"{prefix.rstrip('.')}'s keys" if prefix else "sections"
    hint = f"did you mean {' or '.join(guesses)}?" if guesses else f"{where}: {', '.join(sorted(fields))}"
    return f"unknown key {prefix}{_name(key)} ({hint})"


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
    if origin is dict:  # a mapping handed on whole (task.dataset_config): its keys are its owner's to check
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {show(value)}")
        for name in value:
            if not isinstance(name, str):
                raise ConfigError(f"{key}: key {show(name)} is not a name")
        return dict(value)
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
        # YAML 1.1 reads "1e-3" as a string. Only ASCII blanks around it: str.strip also takes control
        # characters such as \x1f, which float() refuses.
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip(" \t\r\n")):
            value = float(value)
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
    "model.n_experts": NON_NEGATIVE, "model.experts_per_token": POSITIVE, "model.moe_d_ff": POSITIVE,
    "model.moe_sparse_step": POSITIVE, "model.router_aux_loss_coef": NON_NEGATIVE,
    "model.query_pre_attn_scalar": POSITIVE, "model.attn_logit_softcap": POSITIVE,
    "model.final_logit_softcap": POSITIVE, "model.sliding_window": POSITIVE, "model.sliding_window_pattern": POSITIVE,
    "model.rope_local_theta": POSITIVE,
    "task.eval_size": POSITIVE, "task.data_seed": NON_NEGATIVE, "task.validation_size": NON_NEGATIVE,
    "task.train_size": NON_NEGATIVE, "task.warmstart_size": NON_NEGATIVE,
    "warmstart.steps": NON_NEGATIVE, "warmstart.batch_size": POSITIVE, "warmstart.learning_rate": POSITIVE,
    "warmstart.teacher_carry_error": Interval(0, 1),
    # Below ~1e-3, logits / temperature overflow float32 and sampling turns to NaN.
    "sampling.temperature": Interval(1e-3), "sampling.top_p": Interval(0, 1, lo_open=True),
    "sampling.top_k": NON_NEGATIVE, "sampling.max_new_tokens": POSITIVE, "sampling.prefill_chunk_size": NON_NEGATIVE,
    "sampling.engine_slots": NON_NEGATIVE, "sampling.engine_chunk_steps": POSITIVE,
    "environment.max_turns": POSITIVE, "environment.workers": NON_NEGATIVE, "environment.step_timeout_s": POSITIVE,
    "environment.eval_slots": POSITIVE,
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
    "train.weight_sync_every": POSITIVE, "train.tis_cap": Interval(1, lo_open=True),
    "train.seq_mask_low": NON_NEGATIVE, "train.seq_mask_high": POSITIVE, "train.m2po_threshold": POSITIVE,
    "train.decoupled_weight_cap": Interval(1, lo_open=True), "train.micro_batch_size": NON_NEGATIVE,
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
    "jaxreplay.models.hf",
    "jaxreplay.replay.limiter",
    "jaxreplay.tasks.registry",
    "jaxreplay.tools.topology",
    "jaxreplay.replay.tables",
    "jaxreplay.replay.server",
    "jaxreplay.replay.writer",
    "jaxreplay.replay.multiprocess",
    "jaxreplay.rollout.actor",
    "jaxreplay.rollout.episodes",
)
_OWNER_CHECKS: dict[str, Callable[[Config], None]] = {}
_MACHINE_CHECKS: dict[str, Callable[[Config], None]] = {}


def owner_check(check: Callable[[Config], None]) -> Callable[[Config], None]:
    """Registers `check(config)` to run at the end of `validate`. A module that owns keys checks
    them itself and registers here, so this module imports no owner; it must be one of `OWNERS`."""
    if check.__module__ not in OWNERS:
        raise RuntimeError(f"{check.__module__} registers a config check but is not in config.OWNERS")
    _OWNER_CHECKS[f"{check.__module__}.{check.__qualname__}"] = check
    return check


def machine_check(check: Callable[[Config], None]) -> Callable[[Config], None]:
    """Registers `check(config)`, of whether this machine can run `config`, with `_validate_machine`
    (configs checked for other machines skip it); as `owner_check`, from one of `OWNERS`."""
    if check.__module__ not in OWNERS:
        raise RuntimeError(f"{check.__module__} registers a machine check but is not in config.OWNERS")
    _MACHINE_CHECKS[f"{check.__module__}.{check.__qualname__}"] = check
    return check


def _owner_checks() -> list[Callable[[Config], None]]:
    for module in OWNERS:
        importlib.import_module(module)
    return sorted(_OWNER_CHECKS.values(), key=lambda check: OWNERS.index(check.__module__))


def _machine_checks() -> list[Callable[[Config], None]]:
    _owner_checks()
    return sorted(_MACHINE_CHECKS.values(), key=lambda check: OWNERS.index(check.__module__))


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
    _require(m.n_experts == 0 or m.experts_per_token <= m.n_experts, "model.experts_per_token",
             f"must not exceed model.n_experts ({m.n_experts}), got {m.experts_per_token}")
    _require(all(0 <= i < m.n_layers for i in m.moe_dense_layers), "model.moe_dense_layers",
             f"every layer index must lie in 0..{m.n_layers - 1}, got {list(m.moe_dense_layers)}")
    _require(not c.train.routing_replay or m.n_experts > 0 or m.hf_path is not None, "train.routing_replay",
             "needs a mixture of experts (model.n_experts > 0)")
    _validate_lora(m.lora)
    _require(t.loss != "asymre" or t.advantage != "group_normalized", "train.advantage",
             "AsymRE needs r - V: use group_centered or leave_one_out, not group_normalized")
    _require(t.seq_mask_low < t.seq_mask_high, "train.seq_mask_high",
             f"must exceed train.seq_mask_low ({t.seq_mask_low}): the interval [{t.seq_mask_low}, {t.seq_mask_high}] "
             "keeps no row")
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


def _validate_lora(lora: LoraConfig) -> None:
    """A finite positive rank and alpha, each target once (the targets' names are checked as they are read)."""
    _require(lora.rank > 0, "model.lora.rank",
             f"must be > 0, got {lora.rank} (no LoRA: leave model.lora.targets empty)")
    _require(lora.rank in INT32, "model.lora.rank", f"{lora.rank} does not fit in 32 bits")
    _require(math.isfinite(lora.alpha) and lora.alpha > 0, "model.lora.alpha", f"must be > 0, got {lora.alpha}")
    dup = next((t for i, t in enumerate(lora.targets) if t in lora.targets[:i]), None)
    _require(dup is None, "model.lora.targets", f"{dup} is named twice")


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
    for check in _machine_checks():
        check(c)
    for key, value in (("run.dir", c.run.dir), ("warmstart.cache_dir", c.warmstart.cache_dir)):
        # With TensorFlow installed (the Reverb lane), Orbax reaches buckets through tf.io.gfile, untested here.
        _require(not storage.is_url(value) or importlib.util.find_spec("tensorflow") is None, key,
                 f"{value}: run dirs and caches in buckets need the default tier (Python >= 3.12, no TensorFlow); "
                 "the Reverb lane writes them to a disk")
    _require(c.task.name != "reasoning_gym" or importlib.util.find_spec("reasoning_gym") is not None, "task.name",
             "reasoning_gym needs reasoning-gym (pip install 'jaxreplay[reasoning_gym]'; pycosat, one of its "
             "dependencies, builds from source with a C compiler: docs/install.md)")
    _require(c.wandb.mode == "disabled" or importlib.util.find_spec("wandb") is not None, "wandb.mode",
             f"{c.wandb.mode} needs wandb (pip install 'jaxreplay[tracking]'), or use disabled")


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
