"""Hugging Face checkpoints in and out: the only module that knows HF tensor names.

Import (`load_hf_model`) takes the architecture from config.json and the weights
from safetensors (one file, or the shards named by model.safetensors.index.json).
Every header is checked before anything is read, so a directory with a missing or
mis-shaped tensor fails at once with the tensor's name. Then each tensor is read from
its memory-mapped file and goes straight to its device; with a sharding, each device's
slice is read on its own (`jax.make_array_from_callback`). Beyond the parameters
themselves the host holds about one tensor at a time, never a full copy per device.

Export (`save_hf_model`) writes config.json, safetensors (sharded above a size, with
its index) and optionally the tokenizer: a directory `transformers` loads. A LoRA model's
adapters are written in PEFT's format too (`save_peft_adapters`), for `peft` to load onto
the HF base.

HF stores a linear weight as [out, in]; our kernels are [in, out], so kernels are
transposed on the way in and out. Everything else keeps its layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

import jax
import numpy as np
from flax import nnx

from jaxreplay import storage
from jaxreplay.compat import is_variable, value_of, with_value
from jaxreplay.config import Config, ConfigError, DType, ModelConfig, machine_check
from jaxreplay.models.errors import HFModelError
from jaxreplay.models.transformer import Transformer, dtype_of, split

if TYPE_CHECKING:
    from jaxreplay.models.tokenizer import HFTokenizer


@dataclasses.dataclass(frozen=True)
class Family:
    """What an HF `model_type` means for our decoder."""

    architecture: str  # the transformers class written to config.json
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on queries and keys (Qwen3, Gemma 3)
    gemma: bool = False  # Gemma's block: (1 + w) norms, four per block, scaled embeddings, GeGLU, local layers
    moe: bool = False  # a mixture of experts in the sparse layers' MLP (Qwen3-MoE)


FAMILIES = {
    "gemma2": Family("Gemma2ForCausalLM", attention_bias=False, qk_norm=False, gemma=True),
    "gemma3_text": Family("Gemma3ForCausalLM", attention_bias=False, qk_norm=True, gemma=True),
    "llama": Family("LlamaForCausalLM", attention_bias=False, qk_norm=False),
    "qwen2": Family("Qwen2ForCausalLM", attention_bias=True, qk_norm=False),
    "qwen3": Family("Qwen3ForCausalLM", attention_bias=False, qk_norm=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", attention_bias=False, qk_norm=True, moe=True),
}

# HF's names of Gemma's layer kinds (config.json's `layer_types`)
_LOCAL, _GLOBAL = "sliding_attention", "full_attention"

# Our parameter path -> HF tensor name. Paths under `layers[i]` are written without
# the ("layers", i) prefix; their HF names get "model.layers.{i}.".
_TOP_LEVEL = {
    ("embed", "embedding"): "model.embed_tokens.weight",
    ("final_norm", "scale"): "model.norm.weight",
    ("lm_head", "kernel"): "lm_head.weight",
}
_PER_LAYER = {
    ("input_norm", "scale"): "input_layernorm.weight",
    ("post_attn_norm", "scale"): "post_attention_layernorm.weight",
    ("attn", "q_proj", "kernel"): "self_attn.q_proj.weight",
    ("attn", "q_proj", "bias"): "self_attn.q_proj.bias",
    ("attn", "k_proj", "kernel"): "self_attn.k_proj.weight",
    ("attn", "k_proj", "bias"): "self_attn.k_proj.bias",
    ("attn", "v_proj", "kernel"): "self_attn.v_proj.weight",
    ("attn", "v_proj", "bias"): "self_attn.v_proj.bias",
    ("attn", "o_proj", "kernel"): "self_attn.o_proj.weight",
    ("attn", "q_norm", "scale"): "self_attn.q_norm.weight",
    ("attn", "k_norm", "scale"): "self_attn.k_norm.weight",
    ("mlp", "gate_proj", "kernel"): "mlp.gate_proj.weight",
    ("mlp", "up_proj", "kernel"): "mlp.up_proj.weight",
    ("mlp", "down_proj", "kernel"): "mlp.down_proj.weight",
    ("pre_mlp_norm", "scale"): "pre_feedforward_layernorm.weight",  # Gemma
    ("post_mlp_norm", "scale"): "post_feedforward_layernorm.weight",  # Gemma
    ("mlp", "router", "kernel"): "mlp.gate.weight",  # Qwen3-MoE's router [E, D]
}
# A sparse layer's experts: one of our tensors [E, in, out] is E of HF's [out, in], one per expert (the layout of
# published checkpoints; transformers 5 fuses them in memory, not on disk).
_EXPERTS = {
    ("mlp", "experts", "gate_proj"): "mlp.experts.{}.gate_proj.weight",
    ("mlp", "experts", "up_proj"): "mlp.experts.{}.up_proj.weight",
    ("mlp", "experts", "down_proj"): "mlp.experts.{}.down_proj.weight",
}

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def hf_name(path: tuple) -> tuple[str, bool]:
    """(HF tensor name, whether it is stored transposed) of one of our parameter paths; for a stack of
    experts, the name with `{}` where each expert's index goes (`hf_names`)."""
    if len(path) > 2 and path[0] == "layers" and path[2:] in _EXPERTS:
        return f"model.layers.{path[1]}.{_EXPERTS[path[2:]]}", True
    if path in _TOP_LEVEL:
        return _TOP_LEVEL[path], path[-1] == "kernel"
    if len(path) > 2 and path[0] == "layers" and path[2:] in _PER_LAYER:
        return f"model.layers.{path[1]}.{_PER_LAYER[path[2:]]}", path[-1] == "kernel"
    raise KeyError(f"no HF name for parameter {'.'.join(map(str, path))}")  # a model change this table missed


def hf_names(path: tuple, shape: tuple[int, ...]) -> tuple[list[str], bool, bool]:
    """(the HF tensor names one of our parameters of `shape` is stored as, transposed, stacked): one name,
    or for a stack of experts [E, ...] one name per expert, stacked on our axis 0."""
    name, transposed = hf_name(path)
    if "{}" not in name:
        return [name], transposed, False
    return [name.format(j) for j in range(shape[0])], transposed, True


# ----------------------------------------------------------------------------------
# config.json <-> ModelConfig


def _checked_config_json(data: bytes, file: str) -> dict:
    """config.json's object, refused in one line where its family or expert counts cannot run:
    the checks that need neither transformers nor the weights, so a run makes them at its edge.
    Decoded as UTF-8 first, as transformers reads it: json.loads(bytes) would guess UTF-16 from a BOM."""
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise HFModelError(f"{file}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise HFModelError(f"{file}: malformed JSON at line {e.lineno}") from None
    if not isinstance(raw, dict):
        raise HFModelError(f"{file}: not a JSON object")
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise HFModelError(f"{file}: unknown architecture model_type={model_type!r} "
                           f"(supported: {', '.join(sorted(FAMILIES))})")
    # Published checkpoints say num_experts; transformers 5 writes num_local_experts. Absent, HF's defaults hold.
    n_experts, top_k = raw.get("num_experts", raw.get("num_local_experts")), raw.get("num_experts_per_tok")
    if FAMILIES[model_type].moe and n_experts is not None and top_k is not None:
        if not (type(n_experts) is int and type(top_k) is int and 0 < top_k <= n_experts):
            raise HFModelError(f"{file}: {model_type} with num_experts_per_tok={top_k} of num_experts={n_experts} "
                               "is not supported (each token goes to 1 to num_experts experts)")
    return raw


@machine_check
def check_model_dirs(c: Config) -> None:
    """`model.hf_path`'s and `model.hf_config`'s config.json, read before the run touches anything
    (a bucket's file alone, not its weights)."""
    from jaxreplay.models.architectures import architecture_dir

    for key, where in (("model.hf_path", c.model.hf_path), ("model.hf_config", c.model.hf_config)):
        if where is None:
            continue
        folder = where if key == "model.hf_path" else architecture_dir(where)  # hf_config: its owner's check
        file = storage.join(folder, "config.json")
        try:
            text = storage.read_bytes(file)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ConfigError(f"{key}: {where} is not a Hugging Face model directory (no config.json)") from None
        except OSError as e:
            raise ConfigError(f"{key}: cannot read {file}: {e.strerror or e}") from None
        try:
            _checked_config_json(text, file)
        except HFModelError as e:
            raise ConfigError(f"{key}: {e}") from None


def _read_hf_config(path: Path) -> Any:
    """The transformers config of `path` (legacy keys such as rope_theta normalised), or a one-line error."""
    file = path / "config.json"
    if not file.is_file():
        raise HFModelError(f"{path} is not a Hugging Face model directory: no config.json")
    _checked_config_json(file.read_bytes(), str(file))
    import transformers  # the demo path never needs it
    from huggingface_hub.errors import StrictDataclassError

    try:
        return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (ValueError, TypeError, KeyError, AttributeError, OSError, StrictDataclassError) as e:
        raise HFModelError(f"{file}: rejected by transformers: {_one_line(e)}") from None


def _one_line(error: Exception, limit: int = 400) -> str:
    """A library's multi-line message on one line, cut at `limit` characters."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def model_config_from_hf(hf: Any, *, param_dtype: DType = "float32", compute_dtype: DType = "float32",
                         max_seq_len: Optional[int] = None, source: str = "config.json") -> ModelConfig:
    """Our ModelConfig for a transformers config; features our decoder lacks are one-line errors.

    `max_seq_len` (longest prompt + completion) is a run setting; None takes the
    checkpoint's max_position_embeddings.
    """
    family = FAMILIES.get(hf.model_type)
    if family is None:
        raise HFModelError(f"{source}: unknown architecture model_type={hf.model_type!r} "
                           f"(supported: {', '.join(sorted(FAMILIES))})")

    def unsupported(ok: bool, what: str) -> None:
        if not ok:
            raise HFModelError(f"{source}: {hf.model_type} with {what} is not supported")

    rope = dict(getattr(hf, "rope_parameters", None) or {})
    gemma = {}
    if family.gemma:
        gemma, rope = _gemma_features(hf, rope, unsupported)
    if family.moe:
        gemma = _moe_features(hf, unsupported)
    rope_type = rope.get("rope_type", "default")
    unsupported(rope_type in ("default", "llama3") or (family.gemma and rope_type == "linear"),
                f"rope_type={rope_type!r} (RoPE scaling)")
    scaling = {}
    if rope_type == "llama3":
        scaling = dict(rope_scaling_factor=float(rope["factor"]), rope_low_freq_factor=float(rope["low_freq_factor"]),
                       rope_high_freq_factor=float(rope["high_freq_factor"]),
                       rope_original_max_len=int(rope["original_max_position_embeddings"]))
    elif rope_type == "linear":
        scaling = dict(rope_scaling_factor=float(rope["factor"]), rope_scaling_type="linear")
    if not family.gemma:
        unsupported(getattr(hf, "hidden_act", "silu") == "silu", f"hidden_act={getattr(hf, 'hidden_act', None)!r}")
        unsupported(not getattr(hf, "use_sliding_window", False), "use_sliding_window=true")
    unsupported(not getattr(hf, "mlp_bias", False), "mlp_bias=true")
    # Qwen2 always has q/k/v biases; in Llama and Qwen3 `attention_bias` also puts one on o_proj.
    unsupported(family.attention_bias or not getattr(hf, "attention_bias", False), "attention_bias=true")
    n_heads = hf.num_attention_heads
    n_kv_heads = getattr(hf, "num_key_value_heads", None) or n_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // n_heads
    # Older transformers (5.17) accept these; our decoder cannot run them.
    if head_dim % 2:
        raise HFModelError(f"{source}: head_dim={head_dim} must be even for RoPE")
    if n_heads % n_kv_heads:
        raise HFModelError(f"{source}: num_key_value_heads={n_kv_heads} must divide num_attention_heads={n_heads}")
    return ModelConfig(
        vocab_size=hf.vocab_size,
        d_model=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        d_ff=hf.intermediate_size,
        max_seq_len=max_seq_len if max_seq_len is not None else hf.max_position_embeddings,
        rope_theta=float(rope.get("rope_theta", 10_000.0)),
        **scaling,
        norm_eps=float(hf.rms_norm_eps),
        tie_embeddings=bool(hf.tie_word_embeddings),
        attention_bias=family.attention_bias,
        qk_norm=family.qk_norm,
        **gemma,
        param_dtype=param_dtype,
        compute_dtype=compute_dtype,
    )


def _gemma_features(hf: Any, rope: dict, unsupported) -> tuple[dict, dict]:
    """(the ModelConfig fields of a Gemma 2 / Gemma 3 config, its global layers' RoPE parameters).

    Gemma 3 keeps one RoPE dict per layer kind: the local layers' base becomes `rope_local_theta`
    (unscaled, as every published Gemma 3 has it), the global layers' dict is the model's RoPE."""
    activation = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None)
    unsupported(activation in ("gelu_pytorch_tanh", "gelu_tanh"), f"hidden_activation={activation!r}")
    unsupported(not getattr(hf, "use_bidirectional_attention", False), "use_bidirectional_attention=true")
    fields = dict(mlp_activation="gelu_tanh", norm_plus_one=True, post_norms=True, scale_embeddings=True,
                  query_pre_attn_scalar=int(hf.query_pre_attn_scalar))
    for ours, theirs in (("attn_logit_softcap", "attn_logit_softcapping"),
                         ("final_logit_softcap", "final_logit_softcapping")):
        if getattr(hf, theirs, None) is not None:
            fields[ours] = float(getattr(hf, theirs))
    if _GLOBAL in rope or _LOCAL in rope:  # Gemma 3
        local = dict(rope.get(_LOCAL) or {})
        unsupported(local.get("rope_type", "default") == "default",
                    f"rope_type={local.get('rope_type')!r} on the sliding-window layers")
        fields["rope_local_theta"] = float(local.get("rope_theta", 10_000.0))
        rope = dict(rope.get(_GLOBAL) or {})
    types = list(getattr(hf, "layer_types", None) or [_GLOBAL] * hf.num_hidden_layers)
    unsupported(set(types) <= {_LOCAL, _GLOBAL}, f"layer_types {sorted(set(types) - {_LOCAL, _GLOBAL})}")
    if _LOCAL in types:
        pattern = types.index(_GLOBAL) + 1 if _GLOBAL in types else len(types) + 1
        regular = [_GLOBAL if (i + 1) % pattern == 0 else _LOCAL for i in range(len(types))]
        unsupported(types == regular, "layer_types that are not every k-th layer global (sliding_window_pattern)")
        unsupported(getattr(hf, "sliding_window", None) is not None, "sliding layers without a sliding_window")
        fields.update(sliding_window=int(hf.sliding_window), sliding_window_pattern=pattern)
    return fields, rope


def _moe_features(hf: Any, unsupported) -> dict:
    """The ModelConfig fields of a Qwen3-MoE config. The load-balancing loss's weight is HF's
    `router_aux_loss_coef` where `output_router_logits` turns it on in HF's own loss, else 0."""
    n_experts, top_k = int(hf.num_experts), int(hf.num_experts_per_tok)
    unsupported(0 < top_k <= n_experts, f"num_experts_per_tok={top_k} of num_experts={n_experts}")
    dense = tuple(sorted(int(i) for i in (getattr(hf, "mlp_only_layers", None) or ())))
    unsupported(all(0 <= i < hf.num_hidden_layers for i in dense), f"mlp_only_layers={list(dense)}")
    coef = float(getattr(hf, "router_aux_loss_coef", 0.0)) if getattr(hf, "output_router_logits", False) else 0.0
    return dict(n_experts=n_experts, experts_per_token=top_k, moe_d_ff=int(hf.moe_intermediate_size),
                moe_norm_topk=bool(getattr(hf, "norm_topk_prob", False)),
                moe_sparse_step=int(getattr(hf, "decoder_sparse_step", 1)), moe_dense_layers=dense,
                router_aux_loss_coef=coef)


def read_model_config(path: str | Path, *, param_dtype: DType = "float32", compute_dtype: DType = "float32",
                      max_seq_len: Optional[int] = None) -> ModelConfig:
    """The ModelConfig of the HF directory `path`, from its config.json alone (no weights read).

    Its `hf_path` is `path`: a config that replaces the user's still says where the model came from.
    """
    named, path = str(path), storage.staged(path)  # a bucket's directory is read from its local copy
    cfg = model_config_from_hf(_read_hf_config(path), param_dtype=param_dtype, compute_dtype=compute_dtype,
                               max_seq_len=max_seq_len, source=storage.join(named, "config.json"))
    return dataclasses.replace(cfg, hf_path=named)


def _gemma_block(cfg: ModelConfig) -> Optional[bool]:
    """Whether `cfg` has Gemma's block (all its features), not (none of them), or None: a mix
    that no HF family holds. Soft-caps, local layers and a score scale exist only in Gemma."""
    gemma = (cfg.norm_plus_one, cfg.post_norms, cfg.scale_embeddings, cfg.mlp_activation == "gelu_tanh")
    if all(gemma):
        return True
    only_gemma = (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.sliding_window, cfg.query_pre_attn_scalar,
                  cfg.rope_local_theta)
    if any(gemma) or any(x is not None for x in only_gemma) or cfg.rope_scaling_type == "linear":
        return None
    return False


def _features(cfg: ModelConfig) -> tuple:
    return cfg.attention_bias, cfg.qk_norm, _gemma_block(cfg), cfg.n_experts > 0


def _family_features(family: Family) -> tuple:
    return family.attention_bias, family.qk_norm, family.gemma, family.moe


def family_of(cfg: ModelConfig) -> str:
    """The HF model_type that holds exactly `cfg`'s features."""
    for model_type, family in FAMILIES.items():
        if _family_features(family) == _features(cfg):
            return model_type
    raise HFModelError(f"no supported HF architecture has attention_bias={cfg.attention_bias} together with "
                       f"qk_norm={cfg.qk_norm}, {_gemma_description(cfg)} and "
                       f"{'experts' if cfg.n_experts else 'no experts'}")


def _gemma_description(cfg: ModelConfig) -> str:
    gemma = _gemma_block(cfg)
    return "Gemma's block" if gemma else "no Gemma block" if gemma is False else (
        "part of Gemma's block (norm_plus_one, post_norms, scale_embeddings and mlp_activation=gelu_tanh go "
        "together, and soft-caps, sliding windows, query_pre_attn_scalar, rope_local_theta or linear RoPE scaling "
        "need them)")


# ----------------------------------------------------------------------------------
# Import


def _inside(path: Path, name: Any, where: str) -> Path:
    """`path / name`, refused unless `name` is a relative file name that stays inside `path`
    (as transformers checks `transformers_weights`)."""
    if not isinstance(name, str) or not name:
        raise HFModelError(f"{where}: {name!r} is not a file name")
    base = os.path.abspath(path)
    full = os.path.abspath(os.path.join(base, name))
    if os.path.commonpath([base, full]) != base or full == base:
        raise HFModelError(f"{where}: {name!r} is outside the model directory {path}")
    return path / name


def _weights_entry(path: Path) -> tuple[Path, bool]:
    """(the weights file transformers loads, whether it is an index), in transformers' own order:
    config.json's `transformers_weights`, else model.safetensors, else model.safetensors.index.json."""
    config = path / "config.json"
    explicit = json.loads(config.read_text()).get("transformers_weights")
    if explicit is not None:
        if not isinstance(explicit, str) or not explicit.endswith((".safetensors", ".safetensors.index.json")):
            raise HFModelError(f"{config}: transformers_weights={explicit!r} is neither a .safetensors file nor a "
                               f".safetensors.index.json")
        entry = _inside(path, explicit, f"{config}: transformers_weights")
        if not entry.is_file():
            raise HFModelError(f"{config}: transformers_weights names {explicit}, which does not exist")
        return entry, explicit.endswith(".safetensors.index.json")
    if (path / SINGLE_FILE).is_file():
        return path / SINGLE_FILE, False
    if (path / INDEX_FILE).is_file():
        return path / INDEX_FILE, True
    other = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".h5", ".msgpack"))
    hint = (f" (found {', '.join(other)}: convert it to safetensors)" if other
            else f" (neither {SINGLE_FILE} nor {INDEX_FILE})")
    raise HFModelError(f"{path} holds no safetensors weights{hint}")


def _weight_files(path: Path, wanted: list[str]) -> tuple[dict[str, Path], Optional[Path]]:
    """(HF tensor name -> the file that should hold it, the index that says so or None), for every
    name in `wanted` that the directory's weights list; a name left out is a missing tensor."""
    entry, is_index = _weights_entry(path)
    if not is_index:
        return {name: entry for name in wanted}, None
    try:
        weight_map = json.loads(entry.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise HFModelError(f"{entry}: not a safetensors index (no weight_map)") from None
    if not isinstance(weight_map, dict):
        raise HFModelError(f"{entry}: weight_map is not a mapping of tensor names to files")
    files = {name: _inside(path, weight_map[name], f"{entry}: weight_map[{name!r}]")
             for name in wanted if name in weight_map}
    for name, file in sorted(files.items(), key=lambda item: str(item[1])):
        if not file.is_file():
            raise HFModelError(f"{entry} names {weight_map[name]}, which does not exist")
    return files, entry


def _read_failure(file: Path, tensor: str, error: Exception) -> HFModelError:
    return HFModelError(f"{file}: cannot read tensor {tensor}: {_one_line(error)}")


@contextlib.contextmanager
def _opened(file: Path, tensor: str) -> Iterator[Any]:
    """`safe_open(file)`; a file safetensors cannot open is a one-line error naming it and
    `tensor`, one that it should hold (safetensors' own error names neither)."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise _read_failure(file, tensor, e) from None
    with handle as f:
        yield f


def _check_headers(path: Path, files: dict[str, Path], index: Optional[Path], wanted: list[str],
                   shapes: dict[str, tuple[int, ...]]) -> None:
    """Every wanted tensor is in its file with the shape the config implies: a bad directory
    fails before any read, naming the tensor and the file."""
    missing = [name for name in wanted if name not in files]
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        if name in files:
            by_file.setdefault(files[name], []).append(name)
    for file, names in sorted(by_file.items()):
        with _opened(file, names[0]) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    if index is None:
                        missing.append(name)
                        continue
                    raise HFModelError(f"{file} does not hold tensor {name}, which {index.name} puts there")
                got = tuple(f.get_slice(name).get_shape())
                if got != shapes[name]:
                    raise HFModelError(f"{file.name}: tensor {name} has shape {list(got)}, the config implies "
                                       f"{list(shapes[name])}")
    if missing:
        first = next(name for name in wanted if name in missing)
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise HFModelError(f"{path}: missing tensor {first}{more}")


def _sharding_map(shardings: Any) -> dict[tuple, jax.sharding.Sharding]:
    """Param path -> Sharding, from a tree shaped like the params (an nnx.State whose leaves
    hold shardings, as `sharding.param_shardings` returns, or a nested mapping)."""
    state = shardings if isinstance(shardings, nnx.State) else nnx.State(shardings)
    flat = {}
    for p, leaf in nnx.to_flat_state(state):
        flat[tuple(p)] = value_of(leaf) if is_variable(leaf) else leaf
    return flat


def load_hf_model(path: str | Path, *, param_dtype: DType = "float32", compute_dtype: DType = "float32",
                  max_seq_len: Optional[int] = None, shardings: Any = None) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """(ModelConfig, graphdef, params) of the Llama/Qwen2/Qwen3/Qwen3-MoE/Gemma model in the HF directory `path`.

    Weights are cast to `param_dtype`. `shardings`: None puts each tensor on the default
    device; otherwise a tree shaped like the params with a `jax.sharding.Sharding` per
    parameter, or a function from the abstract params (shapes, dtypes, logical axes) to
    that tree, e.g. `lambda abstract: sharding.param_shardings(mesh, abstract)`.
    """
    cfg = read_model_config(path, param_dtype=param_dtype, compute_dtype=compute_dtype, max_seq_len=max_seq_len)
    path = storage.staged(path)
    graphdef, abstract = split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0))))
    targets = {tuple(p): var for p, var in nnx.to_flat_state(abstract)}
    placement = {}
    if shardings is not None:
        placement = _sharding_map(shardings(abstract) if callable(shardings) else shardings)
        unplaced = [p for p in targets if p not in placement]
        if unplaced:
            raise HFModelError(f"shardings has no entry for parameter {'.'.join(map(str, unplaced[0]))}")

    names = {p: hf_names(p, tuple(value_of(var).shape)) for p, var in targets.items()}
    wanted = [name for parts, _, _ in names.values() for name in parts]
    files, index = _weight_files(path, wanted)
    shapes = {}
    for p, (parts, transposed, stacked) in names.items():
        shape = tuple(value_of(targets[p]).shape)[1 if stacked else 0:]
        shapes.update((name, shape[::-1] if transposed else shape) for name in parts)
    _check_headers(path, files, index, wanted, shapes)

    from safetensors import SafetensorError

    dtype = np.dtype(dtype_of(param_dtype))
    loaded = {}
    for p in sorted(targets, key=lambda p: (str(files[names[p][0][0]]), names[p][0][0])):
        parts, transposed, stacked = names[p]
        # Files are mapped per tensor: pages read stay resident only while they are open.
        with contextlib.ExitStack() as opened:
            handles = {}
            for name in parts:
                if files[name] not in handles:
                    handles[files[name]] = opened.enter_context(_opened(files[name], name))
            try:
                views = [handles[files[name]].get_slice(name) for name in parts]
                array = _place(views, transposed, stacked, tuple(value_of(targets[p]).shape), dtype,
                               placement.get(p))
            except SafetensorError as e:
                raise _read_failure(files[parts[0]], parts[0], e) from None
        loaded[p] = with_value(targets[p], array)
    return cfg, graphdef, nnx.from_flat_state(loaded)


def _place(views: list, transposed: bool, stacked: bool, shape: tuple[int, ...], dtype: np.dtype,
           sharding: Optional[jax.sharding.Sharding]) -> jax.Array:
    """One tensor on device(s), read from the file slice by slice when it is sharded; `stacked`: from
    one file tensor per index of its axis 0 (experts), reading only the experts a device holds."""

    def one(view: Any, index: tuple) -> np.ndarray:
        x = view[index[::-1] if transposed else index]
        return np.ascontiguousarray(x.T if transposed else x, dtype=dtype)

    def read(index: tuple = ()) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        if not stacked:
            return one(views[0], index)
        return np.stack([one(views[j], index[1:]) for j in range(shape[0])[index[0]]])

    if sharding is None:
        return jax.device_put(read())
    return jax.make_array_from_callback(shape, sharding, read)


# ----------------------------------------------------------------------------------
# Export


def save_hf_model(path: str | Path, cfg: ModelConfig, params: nnx.State, *, tokenizer: Optional[HFTokenizer] = None,
                  base: str | Path | None = None, dtype: Optional[DType] = None,
                  max_shard_bytes: int = 4 << 30) -> Path:
    """Writes `params` as an HF model directory at `path` (created if needed); returns it.

    `base`: the HF directory the model was imported from; its config.json keeps every
    key our config does not set (special token ids, generation defaults) and its
    generation_config.json is copied. `dtype` casts the saved tensors (default: as
    stored). Files above `max_shard_bytes` are split into shards with an index. One
    shard at a time is gathered to the host (from this process's devices: a multi-host
    run's params must be gathered first). Weight files of an earlier export into `path`
    that this one does not rewrite are removed, so no loader can pick stale weights;
    no other file is touched. `path` may not be `base` or the tokenizer's directory.
    """
    path = Path(path)
    _check_destination(path, base, tokenizer)
    model_type = _read_hf_config(Path(base)).model_type if base is not None else family_of(cfg)
    family = FAMILIES[model_type]
    if _family_features(family) != _features(cfg):
        raise HFModelError(f"cannot save as {model_type}: it has attention_bias={family.attention_bias}, "
                           f"qk_norm={family.qk_norm}, gemma={family.gemma}, moe={family.moe}; the model has "
                           f"{cfg.attention_bias}, {cfg.qk_norm}, {_gemma_description(cfg)}, "
                           f"{'experts' if cfg.n_experts else 'no experts'}")
    flat = {tuple(p): value_of(var) for p, var in nnx.to_flat_state(params)}
    out_dtype = np.dtype(dtype_of(dtype)) if dtype is not None else None
    path.mkdir(parents=True, exist_ok=True)

    entries = []  # (HF name, our path, the expert's index in a stacked tensor or None)
    for p in flat:
        parts, _, stacked = hf_names(p, tuple(flat[p].shape))
        entries += [(name, p, j if stacked else None) for j, name in enumerate(parts)]
    entries.sort()  # HF's own order: lm_head, then model.*
    shards: list[list[tuple[str, tuple, Optional[int]]]] = [[]]
    size = 0
    for name, p, j in entries:
        nbytes = flat[p].size // (1 if j is None else flat[p].shape[0]) * (out_dtype or flat[p].dtype).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, p, j))
        size += nbytes

    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = SINGLE_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, p, j in shard:
            x = np.asarray(jax.device_get(flat[p] if j is None else flat[p][j]))
            x = x.T if hf_name(p)[1] else x
            tensors[name] = np.ascontiguousarray(x, dtype=out_dtype or x.dtype)
            weight_map[name] = file
            total += tensors[name].nbytes
        _save_weights(tensors, path / file)
        del tensors
    written = set(weight_map.values())
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.add(INDEX_FILE)
    for stale in _weight_file_names(path) - written:  # after the new files: the directory is never without weights
        (path / stale).unlink()

    _hf_config(cfg, model_type, base, dtype or cfg.param_dtype, tokenizer).save_pretrained(str(path))
    if base is not None and (Path(base) / "generation_config.json").is_file():
        shutil.copyfile(Path(base) / "generation_config.json", path / "generation_config.json")
    if tokenizer is not None:
        tokenizer.save(path)
    return path


# PEFT's files for one LoRA adapter, and its names of our two factors (jaxreplay/models/lora.py)
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_PEFT_FACTORS = {"lora_a": "lora_A", "lora_b": "lora_B"}


def peft_name(path: tuple) -> str:
    """PEFT's tensor name of one of our adapter paths (a Linear's path, then lora_a or lora_b):
    base_model.model.<the HF module>.lora_A.weight, as `PeftModel.save_pretrained` writes it."""
    *owner, factor = path
    module = hf_name(tuple(owner) + ("kernel",))[0].removesuffix(".weight")
    return f"base_model.model.{module}.{_PEFT_FACTORS[factor]}.weight"


def save_peft_adapters(path: str | Path, cfg: ModelConfig, params: nnx.State, *, base: str | Path | None = None,
                       dtype: Optional[DType] = None) -> Path:
    """Writes the LoRA adapters of `params` (`cfg.lora`'s) in PEFT's format at `path`: adapter_config.json
    and adapter_model.safetensors, which `peft.PeftModel.from_pretrained` loads onto the HF base.

    PEFT stores lora_A as [r, in] and lora_B as [out, r] with the delta (lora_alpha / r) * B @ A on a
    weight [out, in]: our factors [in, r] and [r, out] transposed, as every kernel is. `base` (the HF
    directory the base came from) is written as base_model_name_or_path. `dtype` casts the tensors.
    """
    from jaxreplay.models.lora import split_adapters

    path = Path(path)
    _check_destination(path, base, None)
    adapters, _ = split_adapters(params)
    flat = {tuple(p): value_of(var) for p, var in nnx.to_flat_state(adapters)}
    if not flat:
        raise HFModelError("no LoRA adapters to export: model.lora.targets is empty")
    out_dtype = np.dtype(dtype_of(dtype)) if dtype is not None else None
    tensors = {}
    for p, x in sorted(flat.items(), key=lambda item: peft_name(item[0])):
        x = np.asarray(jax.device_get(x)).T
        tensors[peft_name(p)] = np.ascontiguousarray(x, dtype=out_dtype or x.dtype)
    path.mkdir(parents=True, exist_ok=True)
    _save_weights(tensors, path / PEFT_WEIGHTS)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None if base is None else str(base),
        "r": cfg.lora.rank, "lora_alpha": cfg.lora.alpha, "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted({name.split(".")[-3] for name in tensors}),  # HF's module names
        "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }
    (path / PEFT_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def remove_peft_adapters(path: str | Path) -> None:
    """Removes the files `save_peft_adapters` writes at `path`, and `path` if that leaves it empty: an
    export of a policy without adapters must not sit beside adapters an earlier export wrote there."""
    path = Path(path)
    for name in (PEFT_CONFIG, PEFT_WEIGHTS):
        (path / name).unlink(missing_ok=True)
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()


_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _weight_file_names(path: Path) -> set[str]:
    """The names in `path` an export writes weights under: model.safetensors, its index, its shards."""
    return {p.name for p in path.iterdir() if (p.is_file() or p.is_symlink()) and (
        p.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_FILE.fullmatch(p.name))}


def _check_destination(path: Path, base: str | Path | None, tokenizer: Optional[HFTokenizer]) -> None:
    """Refuses, before anything is written, an export over its own sources or onto a file."""
    if path.exists() and not path.is_dir():
        raise HFModelError(f"cannot export to {path}: it is a file, not a directory")
    sources = [("the base model", base)] + ([("the tokenizer", tokenizer.name_or_path)] if tokenizer else [])
    for what, source in sources:
        if source is not None and path.is_dir() and Path(source).is_dir() and os.path.samefile(path, source):
            raise HFModelError(f"cannot export to {path}: it is the directory of {what} the export reads; "
                               f"choose another output directory")


def _save_weights(tensors: dict[str, np.ndarray], file: Path) -> None:
    """safetensors creates its files mode 0600; this one gets the mode any new file gets
    (0644 under the usual umask), so others who may read the directory can load it."""
    from safetensors.numpy import save_file

    file.unlink(missing_ok=True)
    file.touch()
    mode = file.stat().st_mode & 0o777
    save_file(tensors, str(file), metadata={"format": "pt"})
    file.chmod(mode)


def _hf_config(cfg: ModelConfig, model_type: str, base: str | Path | None, dtype: DType,
               tokenizer: Optional[HFTokenizer]) -> Any:
    """The transformers config of `cfg`: `base`'s, with every field our config determines overwritten."""
    import transformers

    if base is not None:
        keep = _read_hf_config(Path(base)).to_dict()
        for derived in ("model_type", "transformers_version", "layer_types"):  # layer_types follows n_layers
            keep.pop(derived, None)
    else:
        keep = {"max_position_embeddings": cfg.max_seq_len}
        if tokenizer is not None:
            # Every stop id, where `generate` (and `load_tokenizer`) look without a generation_config.json.
            eos = tokenizer.eos_id if len(tokenizer.eos_ids) == 1 else list(tokenizer.eos_ids)
            keep.update(eos_token_id=eos, pad_token_id=tokenizer.pad_id, bos_token_id=tokenizer.bos_id)
    fields = dict(
        architectures=[FAMILIES[model_type].architecture], vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, intermediate_size=cfg.d_ff, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu", dtype=dtype,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
    )
    if cfg.rope_scaling_factor != 1.0:
        fields["rope_parameters"] = {
            "rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len}
    if model_type != "qwen2":
        fields["attention_bias"] = False
    if FAMILIES[model_type].moe:
        fields.update(num_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                      moe_intermediate_size=cfg.moe_d_ff, norm_topk_prob=cfg.moe_norm_topk,
                      decoder_sparse_step=cfg.moe_sparse_step, mlp_only_layers=list(cfg.moe_dense_layers),
                      output_router_logits=cfg.router_aux_loss_coef > 0)
        if cfg.router_aux_loss_coef > 0:
            fields["router_aux_loss_coef"] = cfg.router_aux_loss_coef
    if FAMILIES[model_type].gemma:
        fields.update(_gemma_hf_fields(cfg, model_type, fields["rope_parameters"]))
        del fields["hidden_act"]
        keep.pop("sliding_window_pattern", None)  # layer_types says it
    return transformers.AutoConfig.for_model(model_type, **{**keep, **fields})


def _gemma_hf_fields(cfg: ModelConfig, model_type: str, rope: dict) -> dict:
    """config.json's Gemma keys for `cfg` (Gemma 3: one RoPE dict per layer kind)."""
    from jaxreplay.models.transformer import is_local_layer

    if model_type == "gemma3_text":
        local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
        rope = {_GLOBAL: rope, _LOCAL: local}
    if cfg.rope_scaling_type == "linear" and cfg.rope_scaling_factor != 1.0:
        glob = {"rope_type": "linear", "rope_theta": cfg.rope_theta, "factor": cfg.rope_scaling_factor}
        rope = {**rope, _GLOBAL: glob} if model_type == "gemma3_text" else glob
    return dict(
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.head_dim,
        attn_logit_softcapping=cfg.attn_logit_softcap, final_logit_softcapping=cfg.final_logit_softcap,
        sliding_window=cfg.sliding_window, rope_parameters=rope,
        layer_types=[_LOCAL if is_local_layer(cfg, i) else _GLOBAL for i in range(cfg.n_layers)])
