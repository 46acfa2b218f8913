"""Short supervised warm start so RL begins from a weak but non-zero policy.

Cached by the settings that produce it (`warmstart_settings`), under `warmstart.cache_dir`
(default: `.warmstart-cache` beside the run dir), so the runs of a sweep that share those
settings compute it once. An entry is written whole into a temporary directory and renamed
into place: a reader never sees half of one, and of two concurrent writers the first rename
wins and the second keeps it. An entry carries the checksum of every array, as checkpoints do
(Orbax does not check the bytes of its array chunks): one that cannot be read back, or whose
arrays changed since, is recomputed with a warning and replaced.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import optax
from tqdm import tqdm

from jaxreplay import storage
from jaxreplay.config import Config, to_dict
from jaxreplay.learn.losses import masked_mean
from jaxreplay.models.transformer import forward
from jaxreplay.rollout.sampling import token_logprobs
from jaxreplay.tasks.arithmetic import ArithmeticTask
from jaxreplay.train.checkpoint import (CHECKSUM_ALGORITHM, checksums, read_error_line, restore_params, save_params,
                                        unmatched)
from jaxreplay.train.guards import Preempted, describe

# Raise when `supervised_warm_start` computes something else from the same settings, or an entry's
# files change: old entries then miss. 2: entries carry their arrays' checksums.
CACHE_FORMAT = 2
SETTINGS_FILE = "settings.json"
CHECKSUMS_FILE = "checksums.json"
PARAMS_DIR = "params"


def make_sft_step(graphdef, optimizer: optax.GradientTransformation):
    def loss_fn(params, tokens, attention_mask, loss_mask):
        logits = forward(graphdef, params, tokens, attention_mask)
        return -masked_mean(token_logprobs(logits, tokens, 1.0), loss_mask)

    def step(params, opt_state, tokens, attention_mask, loss_mask):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, attention_mask, loss_mask)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def warmstart_settings(config: Config) -> dict[str, Any]:
    """What determines the warm-start params: the initial params (the model section and run.seed:
    `init_params`), the demonstrations (the task section, run.seed, sampling.max_new_tokens and
    warmstart.teacher_carry_error) and the training (warmstart.*), and JAX's version, whose
    numerics may differ. Not where they are cached, nor `model.hf_config` (only `compile` reads it), nor
    `model.lora` (the warm start trains the base: LoRA runs share the full run's entry)."""
    c = to_dict(config)
    return {
        "format": CACHE_FORMAT,
        "jax": jax.__version__,
        "model": {k: v for k, v in c["model"].items() if k not in ("hf_config", "lora")},
        "task": c["task"],
        "warmstart": {k: v for k, v in c["warmstart"].items() if k != "cache_dir"},
        "run.seed": config.run.seed,
        "sampling.max_new_tokens": config.sampling.max_new_tokens,
    }


def cache_key(config: Config) -> str:
    """A short hash of `warmstart_settings`: the name of the cache entry."""
    text = json.dumps(warmstart_settings(config), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_root(config: Config) -> str:
    """`warmstart.cache_dir`, or `.warmstart-cache` in the parent of `run.dir` (on a disk or in a
    bucket), so that runs started side by side share it (a sweep names its own, above every
    setting's runs)."""
    if config.warmstart.cache_dir:
        return config.warmstart.cache_dir
    if storage.is_url(config.run.dir):
        return storage.join(config.run.dir.rstrip("/").rsplit("/", 1)[0], ".warmstart-cache")
    return str(Path(config.run.dir).absolute().parent / ".warmstart-cache")


def warm_start(graphdef, params, task: ArithmeticTask, config: Config, cache_dir: Optional[str | Path] = None,
               log: Callable[[str], None] = print, stopping: Callable[[], Optional[int]] = lambda: None):
    """Supervised next-token training on correct answers; returns (params, was_cached).

    `cache_dir`: the cache's root (default `cache_root(config)`); entries are named by `cache_key`.
    With warmstart.steps 0 there is nothing to cache. A multi-process job computes it on every
    process (SPMD, like the learner) and caches nothing: Orbax writes there are collective.
    `stopping` (guards.stop_poll), asked before each step: see `supervised_warm_start`."""
    if config.warmstart.steps == 0:
        return params, False
    if jax.process_count() > 1:
        return supervised_warm_start(graphdef, params, task, config, stopping), False
    root = str(cache_dir) if cache_dir is not None else cache_root(config)
    settings = warmstart_settings(config)
    entry = storage.join(root, cache_key(config))
    damaged = None
    if storage.exists(entry):
        try:
            return _read(entry, settings, params), True
        except Exception as e:  # noqa: BLE001 - any damage to the entry means recomputing it
            log(f"warning: the cached warm start {entry} is damaged ({read_error_line(e)}); "
                "recomputing it and replacing the entry")
            damaged = _identity(entry)
    params = supervised_warm_start(graphdef, params, task, config, stopping)
    try:
        if storage.is_url(entry):
            _publish_to_bucket(entry, settings, params)
        else:
            _publish(Path(entry), settings, params, replace=damaged)
    except Exception as e:  # noqa: BLE001 - the run has its warm start; only the next one loses the cache
        log(f"warning: cannot cache the warm start in {entry}: {getattr(e, 'strerror', None) or e}")
    return params, False


def _read(entry: str, settings: dict[str, Any], params_like):
    stored = json.loads(storage.read_text(storage.join(entry, SETTINGS_FILE)))
    if stored != json.loads(json.dumps(settings)):
        raise ValueError(f"its {SETTINGS_FILE} holds other settings than those its name hashes")
    sums = json.loads(storage.read_text(storage.join(entry, CHECKSUMS_FILE)))
    if sums.get("algorithm") != CHECKSUM_ALGORITHM:
        raise ValueError(f"its {CHECKSUMS_FILE} was made by {sums.get('algorithm')!r}, not {CHECKSUM_ALGORITHM!r}")
    params = restore_params(storage.join(entry, PARAMS_DIR), params_like)
    if why := unmatched(params, sums, storage.join(entry, PARAMS_DIR)):
        raise ValueError(why)
    return params


def _write_files(entry: str, settings: dict[str, Any], params) -> None:
    """The params, their checksums, then the settings file, which marks the entry complete where
    there is no rename (a bucket: `_read` fails without it, and the entry is written again)."""
    save_params(storage.join(entry, PARAMS_DIR), params)
    storage.write_text(storage.join(entry, CHECKSUMS_FILE), json.dumps(checksums(params), indent=2) + "\n")
    storage.write_text(storage.join(entry, SETTINGS_FILE), json.dumps(settings, indent=2, sort_keys=True) + "\n")


def _publish_to_bucket(entry: str, settings: dict[str, Any], params) -> None:
    """A bucket has no rename: the entry is deleted and written where it is (`_write_files`)."""
    storage.rmtree(entry)
    _write_files(entry, settings, params)


def _identity(entry: str) -> Optional[tuple[int, int]]:
    """Which directory holds the entry now (device, inode), to tell the damaged one from its replacement."""
    if storage.is_url(entry):
        return None
    try:
        st = os.stat(entry)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _publish(entry: Path, settings: dict[str, Any], params, replace: Optional[tuple[int, int]] = None) -> None:
    """Writes the entry in a temporary directory beside it, then renames it into place. If another
    writer's entry appeared meanwhile, that one is kept (the same settings give the same params).
    `replace`: the `_identity` of the damaged entry found there, moved aside first; if another
    writer has already replaced it, the replacement is kept (the first rename wins)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
    try:
        _write_files(str(tmp), settings, params)
        if replace is not None:
            aside = entry.parent / f".stale-{entry.name}-{uuid.uuid4().hex[:8]}"
            try:
                entry.rename(aside)
            except FileNotFoundError:  # another writer moved it already
                pass
            if aside.exists() and _identity(str(aside)) != replace:  # another writer's replacement: put back
                with contextlib.suppress(OSError):  # unless a third one's is there already
                    aside.rename(entry)
            shutil.rmtree(aside, ignore_errors=True)
        try:
            tmp.rename(entry)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def supervised_warm_start(graphdef, params, task: ArithmeticTask, config: Config,
                          stopping: Callable[[], Optional[int]] = lambda: None):
    """The warm start itself, uncached: deterministic given params and config. It can take
    minutes, so it shows a progress bar (`run.progress_bar`), and a stop signal (`stopping()`,
    asked before each step) ends it with `Preempted`: nothing is cached or saved half-done."""
    w = config.warmstart
    optimizer = optax.adam(w.learning_rate)
    opt_state = optimizer.init(params)
    step = make_sft_step(graphdef, optimizer)
    # Multi-process CPU: gloo pairs collectives by order, so no local device may start a step early.
    lockstep = jax.process_count() > 1 and jax.default_backend() == "cpu"
    # A stream of its own so warm-start problems are not the RL prompt stream.
    seed = config.run.seed + 7_919
    for i in tqdm(range(w.steps), desc="warm start", unit="step", disable=not config.run.progress_bar,
                  dynamic_ncols=True):
        if signum := stopping():
            raise Preempted(f"{describe(signum)} during the warm start (step {i} of {w.steps}): no learner step "
                            "ran, so there is no checkpoint to save; the same command starts over", signum)
        tokens, attention_mask, loss_mask = task.supervised_batch(
            seed, i, w.batch_size, config.sampling.max_new_tokens, carry_error=w.teacher_carry_error
        )
        params, opt_state, _ = step(params, opt_state, tokens, attention_mask, loss_mask)
        if lockstep:
            jax.block_until_ready((params, opt_state))
    return params
