"""Orbax checkpoints of the learner, tied to the Reverb checkpoint taken with them.

A checkpoint is one Orbax step holding two items: `state` (params, optimizer
state, RNG key; with LoRA the adapters and their optimizer state, the base named by its
checksum in `meta`: `base_digest`) and `meta` (counters, the path of the Reverb checkpoint taken
just before, so a resume restores exactly that buffer, never a newer orphan, the
run-changing settings the step was trained with, which a resume is checked
against even where config.yaml is gone or edited, and a checksum of every array
of `state`, computed on the device as it is saved (`digests`, below) and checked on
the arrays a restore reads back: a step whose files were cut short or changed
since is `DamagedStep`, never restored silently).
Orbax finalises a step by an atomic rename, so a half-written one is never listed;
steps past `keep` are likewise renamed away before they are deleted, so a kill
mid-delete leaves no half-deleted step listed either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxreplay import storage
from jaxreplay.learn import trainable


@dataclasses.dataclass
class Progress:
    """Everything besides arrays that a resume needs to continue exactly."""

    learner_step: int = 0
    policy_version: int = 0
    actor_step: int = 0  # index of the next prompt batch in the task's stream
    actor_version: int = 0  # the policy version of the weights the actor generates with
    engine_started: int = 0  # sampling.engine continuous: prompt groups this process submitted to its engine
    engine_in_flight: list = dataclasses.field(default_factory=list)  # of those, not complete: regenerated on resume
    engine_positions: list = dataclasses.field(default_factory=list)  # multi-host: every process's [started, in_flight]
    replay_counters: dict = dataclasses.field(default_factory=dict)  # the table's at the checkpoint, checked on resume
    replay_checkpoint: Optional[str] = None  # relative to the run dir; multi-host: a JSON list, one per process
    rows_inserted: int = 0  # by this process (multi-host: each process its own)
    rows_sampled: int = 0
    tokens_generated: int = 0
    tokens_trained: int = 0
    nonfinite_steps: int = 0  # learner steps skipped for a non-finite loss, gradient or update
    time_generate_s: float = 0.0
    time_train_s: float = 0.0
    time_replay_s: float = 0.0
    time_total_s: float = 0.0  # wall-clock seconds of the run up to this checkpoint, every invocation counted
    warmstart_accuracy: Optional[float] = None
    eval_accuracy: Optional[float] = None  # the latest evaluation
    eval_tokens: int = 0  # tokens generated at the latest evaluation (train.eval_every_tokens)
    accounting: dict = dataclasses.field(default_factory=dict)  # jaxreplay.train.accounting counters
    base_digest: str = ""  # LoRA: the frozen base's checksum (`base_digest`), which a resume's base must match


class CheckpointError(ValueError):
    """A checkpoint that is missing, or that exists but cannot be read back."""


class DamagedStep(CheckpointError):
    """A step whose files were cut short or changed since they were written: a read error of the
    storage layer (a short file, a failed CRC), or an array whose checksum is not the one saved."""

    def __init__(self, step: int, why: str):
        super().__init__(why)
        self.step = step


# What the storage layer says when a file it reads is damaged (not when a restore is asked for a
# different structure, which is no reason to pass a step over)
_READ_DAMAGE = ("DATA_LOSS", "CRC", "checksum", "Error reading", "error while reading", "Error decoding",
                "Unexpected end", "OUT_OF_RANGE", "NOT_FOUND", "truncated", "corrupt")


def _first_line(e: BaseException) -> str:
    """The first line of `e`'s message, without the spec and source lines tensorstore appends."""
    line = (str(e).strip().splitlines() or [""])[0]
    for tail in (" [tensorstore_spec=", " [source locations="):
        line = line.split(tail)[0]
    return line[:1000]


def _damage_in(error: BaseException) -> Optional[BaseException]:
    """The read error behind `error` that says a file is damaged, if one does: the innermost,
    which names the array and the file (the outer ones print tensorstore's whole spec)."""
    seen, e, found = set(), error, None
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if any(marker in str(e) for marker in _READ_DAMAGE):
            found = e
        e = e.__cause__ or e.__context__
    return found


def read_error_line(error: BaseException) -> str:
    """`error` in one line: the read error behind it that names the damaged file, where one does."""
    shown = _damage_in(error) or error
    return f"{type(shown).__name__}: {_first_line(shown)}"


@contextlib.contextmanager
def _unreadable(directory: str | Path, step: int, item: str = ""):
    """Orbax's many (often multi-line) errors for a damaged or mismatched step, as one line."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with the step named
        if damage := _damage_in(e):
            where = storage.join(str(directory), str(step), *([item] if item else []))
            raise DamagedStep(step, f"{where} cannot be read ({type(damage).__name__}: {_first_line(damage)})") from e
        raise CheckpointError(f"checkpoint step {step} in {directory} cannot be restored "
                              f"({type(e).__name__}: {_first_line(e)})") from e


# What an OS-level write failure says, where a library hands it on as text (tensorstore's errors)
_WRITE_FAILURES = {errno.ENOSPC: "No space left on device", errno.EROFS: "Read-only file system",
                   errno.EDQUOT: "Disk quota exceeded"}


def write_failure(error: BaseException) -> Optional[OSError]:
    """The OS-level write failure (disk full, read-only, quota) behind `error`, if one is: the
    first such OSError along its causes, preferring one that names its file."""
    found: list[OSError] = []
    seen, e = set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _WRITE_FAILURES:
            found.append(e)
        else:
            for code, text in _WRITE_FAILURES.items():
                if text in str(e):
                    found.append(OSError(code, text))
        e = e.__cause__ or e.__context__
    return next((e for e in found if e.filename), found[0] if found else None)


def write_failure_message(failure: OSError, where: Optional[str] = None) -> str:
    """The one line for an OS-level write failure (after `jaxreplay: error: `)."""
    return (f"cannot write {failure.filename or where or '?'}: {failure.strerror or failure}; the latest complete "
            "checkpoint is unchanged: free space (or make it writable) and run the same command again")


_DELETED = ".deleted"  # steps past `keep` are renamed in here, then deleted
SETTINGS = "trained_with"  # meta's key for the run-changing settings; absent in steps written before it
CHECKSUMS = "checksums"  # meta's key for {"algorithm", "leaves": {name: digest}}; absent in steps written before it


_COMMITTED = "commit_success.txt"  # how Orbax marks a finished step where it cannot rename (a bucket)
_STEP_METADATA = "_CHECKPOINT_METADATA"  # Orbax's; its commit time is written once every file of the step is


def _mark_committed_copies(url: str, *, reader: bool = False) -> None:
    """Marks as finished, as Orbax would have, each step in the bucket directory `url` that was
    finished elsewhere. Orbax lists a bucket's step only once its commit_success.txt is there, and
    deletes the others on start as unfinished; orbax-checkpoint 0.12.0 (the GPU image's) writes
    none on a local disk, where the rename finishes a step. So a run dir trained on a disk and
    copied into a bucket would lose every step. A step whose metadata holds its commit time is
    whole: Orbax writes that time once the step's files are, and the marker next. A `reader`
    (eval, export) may hold read-only access: where it cannot write, the step stays unlisted."""
    if not storage.is_url(url) or not storage.isdir(url):
        return
    for name in storage.listdir(url):
        step = storage.join(url, name)
        if not name.isdigit() or storage.exists(storage.join(step, _COMMITTED)):
            continue
        try:
            committed = json.loads(storage.read_text(storage.join(step, _STEP_METADATA))).get("commit_timestamp_nsecs")
        except (OSError, ValueError, AttributeError):  # missing or cut short: unfinished, Orbax's to delete
            continue
        if not committed:
            continue
        try:
            storage.write_text(storage.join(step, _COMMITTED), f"Checkpoint commit was successful to {step}")
        except Exception:  # noqa: BLE001 - whatever the client raises for a denied write
            if not reader:
                raise


def _reading_manager(directory: str | Path) -> ocp.CheckpointManager:
    """An Orbax manager that only reads `directory` (no pruning, no tidying), listing a bucket's
    steps finished elsewhere (`_mark_committed_copies`)."""
    _mark_committed_copies(str(directory), reader=True)
    return ocp.CheckpointManager(storage.orbax_path(directory))


class Checkpointer:
    def __init__(self, directory: Any, keep: int, timeout_s: Optional[float] = None,
                 settings: Optional[dict] = None):
        """`directory`: a local path or a bucket URL (either as `storage.orbax_path` gives it).
        `timeout_s`: how long Orbax's barriers between processes wait (`distributed.timeout_s`),
        instead of its own 20 minutes. `settings`: the run-changing settings each step records
        (recorder.run_settings); update it when they change (a calibrated ratio)."""
        self.settings = settings
        # A bucket's path (etils' epath, which run_dir.checkpoints() gives) is kept as it is: made a
        # pathlib path, it would print as /gs/... and be taken for a disk.
        self.directory = storage.orbax_path(directory) if isinstance(directory, (str, Path)) else directory
        # A step killed mid-write stays a tmp directory, never listed, deleted on the next start. On a
        # bucket (no rename) steps past `keep` are deleted where they are.
        local = isinstance(self.directory, Path)
        _mark_committed_copies(str(self.directory))
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False,
                                                 cleanup_tmp_directories=True,
                                                 todelete_subdir=_DELETED if local else None,
                                                 **({} if timeout_s is None else
                                                    {"async_options": ocp.AsyncOptions(timeout_secs=max(1, int(timeout_s)))})),
        )
        self._clear_deleted()

    def _clear_deleted(self) -> None:
        if isinstance(self.directory, Path):
            shutil.rmtree(self.directory / _DELETED, ignore_errors=True)

    def latest_step(self) -> Optional[int]:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def reload(self) -> None:
        """Lists the steps again (one was moved away by another hand: a damaged step set aside)."""
        self._manager.reload()

    def save(self, step: int, state: Any, progress: Progress) -> None:
        """A full disk (or a read-only one, or a quota) raises an OSError naming the step's
        directory; the step is then never listed, so the latest complete one stays the latest."""
        try:
            self._save(step, state, progress)
        except Exception as e:
            failure = write_failure(e)
            if failure is None:
                raise
            raise OSError(failure.errno, _WRITE_FAILURES[failure.errno],
                          failure.filename or storage.join(str(self.directory), str(step))) from e

    def _save(self, step: int, state: Any, progress: Progress) -> None:
        sums = checksums(state)  # of the arrays saved, on device
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave({**dataclasses.asdict(progress), CHECKSUMS: sums,
                                        **({} if self.settings is None else {SETTINGS: self.settings})}),
            ),
            force=True,
        )
        self._manager.wait_until_finished()
        self._clear_deleted()

    def replay_checkpoints(self) -> set[str]:
        """The Reverb checkpoints that the kept steps refer to."""
        paths = set()
        for step in self._manager.all_steps():
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
            if meta.get("replay_checkpoint"):
                paths.add(meta["replay_checkpoint"])
        return paths

    def trained_with(self, step: int) -> Optional[dict]:
        """The run-changing settings step `step` was trained with; None for a step written before
        checkpoints recorded them."""
        return self.meta(step).get(SETTINGS)

    def meta(self, step: int) -> dict:
        """Step `step`'s `meta` item alone (counters, replay checkpoint, settings)."""
        with _unreadable(self.directory, step):
            return dict(self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)

    def restore(self, state_like: Any, step: Optional[int] = None) -> tuple[Any, Progress]:
        """Restores onto the structure, shapes, dtypes and shardings of `state_like`, checked
        against the checksums saved with it; a damaged step raises `DamagedStep`."""
        state, meta, step = self.read(state_like, step)
        self.check(state, meta, step)
        return state, progress_of(meta)

    def read(self, state_like: Any, step: Optional[int] = None) -> tuple[Any, dict, int]:
        """(state, meta, step) as read, unchecked (`check`): multi-host, every process reads its
        own shards, and all learn whether any failed before the collective check."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_like)
        with _unreadable(self.directory, step, "state"):
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()),
            )
            return restored.state, dict(restored.meta), step

    def check(self, state: Any, meta: dict, step: int) -> None:
        """`DamagedStep` naming the first array of `state` whose checksum is not the one saved
        (collective multi-host: every process gets the same answer). Steps saved before the
        checksums are not checked."""
        check_sums(state, meta, step, storage.join(str(self.directory), str(step), "state"))

    def close(self) -> None:
        self._manager.close()


def progress_of(meta: dict) -> Progress:
    return Progress(**{k: v for k, v in meta.items() if k not in (SETTINGS, CHECKSUMS)})


def check_sums(state: Any, meta: dict, step: int, where: str) -> None:
    sums = meta.get(CHECKSUMS)
    if not sums or sums.get("algorithm") != CHECKSUM_ALGORITHM:
        return
    if why := unmatched(state, sums, where):
        raise DamagedStep(step, why)


class OtherBase(CheckpointError):
    """A LoRA checkpoint resumed on a base other than the one its adapters were trained on."""


def base_digest(params: Any) -> str:
    """The frozen base's checksum where `params` hold LoRA adapters (the digests of its arrays, as
    checkpoints record them, hashed into 16 hex digits); "" for params that all train. A LoRA
    checkpoint holds the adapters and this, not the base: the base stays where it came from (the
    HF directory, the warm-start cache)."""
    _, frozen = trainable.split(params)
    if frozen is None:
        return ""
    text = json.dumps(digests(frozen), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def saved_params(params: Any) -> Any:
    """What a checkpoint holds of `params`: the trainable part (with LoRA, the adapters alone)."""
    return trainable.split(params)[0]


def restored_params(params: Any, saved: Any, saved_digest: str, fresh_digest: str, where: str) -> Any:
    """The run's params from a checkpoint's `saved_params`, on `params`' frozen base, which must be
    the one the checkpoint was trained on (`OtherBase` otherwise, in one line)."""
    if saved_digest != fresh_digest:
        raise OtherBase(f"{where} was trained on a base whose checksum is {saved_digest or 'none (no LoRA)'}, but "
                        f"this run's base is {fresh_digest or 'none (no LoRA)'}: resume it on the base it was trained "
                        "on (the same model.hf_path weights, or the same warm start)")
    return trainable.join(saved, trainable.split(params)[1])


def save_params(path: str | Path, params: Any) -> None:
    """One-off params snapshot (the cached warm start)."""
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(storage.orbax_path(path), params, force=True)


def restore_params(path: str | Path, params_like: Any) -> Any:
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, params_like)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(storage.orbax_path(path), abstract)


def read_meta(directory: str | Path, step: int) -> dict:
    """Step `step`'s `meta` item alone, read without a `Checkpointer` (which would prune and tidy)."""
    manager = _reading_manager(directory)
    try:
        with _unreadable(directory, step):
            return dict(manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)
    finally:
        manager.close()


def restore_policy_params(directory: str | Path, params_like: Any, step: Optional[int] = None) -> tuple[Any, int]:
    """(params, step) of a training checkpoint, read alone: evaluation needs neither the
    optimizer state nor the waiting rollouts. `params_like` may be abstract (shapes,
    dtypes, shardings); the default device is used where it has no sharding."""
    manager = _reading_manager(directory)
    try:
        step = manager.latest_step() if step is None else step
        if step is None or step not in manager.all_steps():
            raise CheckpointError(f"no complete checkpoint{'' if step is None else f' at step {step}'} in "
                                  f"{directory}")
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        tree = {"params": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None) or device),
            params_like)}
        with _unreadable(directory, step):
            restored = manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item=tree, restore_args=ocp.checkpoint_utils.construct_restore_args(tree),
                                             transforms={}),
                meta=ocp.args.JsonRestore()))
        check_sums({"params": restored.state["params"]}, dict(restored.meta), step,
                   storage.join(str(directory), str(step), "state"))
        return restored.state["params"], step
    finally:
        manager.close()


# -- checksums of the arrays saved ------------------------------------------------------------
# Per-array checksums of checkpointed state, computed on the device from the arrays themselves.
#
# Orbax (through tensorstore) checks its own index and b-tree nodes, but not the array chunks:
# bytes changed inside a chunk are restored silently. So a checkpoint records a 64-bit digest
# of every leaf of what it saves, and a restore recomputes them on the arrays it read back,
# before anything trains on them.
#
# The digest is computed where the arrays live, in one jitted pass that reads each element once
# (no second pass over the state on the host): each element's bits, as 32-bit words, are mixed
# with its flat position by a bijective 32-bit hash (MurmurHash3's finaliser) and summed modulo
# 2**32, in two lanes with different constants. Integer addition is exact, so the sum is the
# same however the array is sharded or the reduction ordered (a resharded restore agrees);
# a bijection of a changed word always changes its term, so any single changed word, in any
# leaf, changes the digest, and more changes cancel with odds of about 2**-64. It reads the
# bits, not the values: a NaN written is a NaN expected.

# Recorded with the digests: a step whose digests another algorithm made is not taken for damage
CHECKSUM_ALGORITHM = "fmix32-sum-2x32/1"

_LANES = ((0x9E3779B9, 0x85EBCA6B), (0x7FEB352D, 0x1B873593))  # (position multiplier, offset) per lane


def _fmix32(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The leaf's bits as uint32 words: one per element of 1, 2 or 4 bytes, two per 8-byte one."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _leaf(x: jax.Array) -> jax.Array:
    """uint32[2]: the leaf's digest, two lanes."""
    words = _words(x)
    position = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):  # the flat (row-major) index, without a reshape that would reshard
        position = position + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= words.shape[axis]
    lanes = tuple(_fmix32(words + position * jnp.uint32(m) + jnp.uint32(c)) for m, c in _LANES)
    zero = jnp.uint32(0)  # both lanes in one pass over the array (two sums read it twice: 6x slower on CPU)
    sums = jax.lax.reduce(lanes, (zero, zero), lambda a, b: (a[0] + b[0], a[1] + b[1]), tuple(range(words.ndim)))
    return jnp.stack(sums)


_digests = jax.jit(lambda tree: jax.tree.map(_leaf, tree))


def leaf_name(path: tuple) -> str:
    """A leaf's key path as 'params/layers/0/mlp/kernel' (the name a mismatch is reported by)."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def digests(tree: Any) -> dict[str, str]:
    """{leaf name: 16 hex digits} for every array in `tree`. Multi-host, each process reads only its
    own shards and the sum is a collective: every process gets the same digests."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    groups: dict[tuple, list[int]] = {}  # one program per set of devices (disaggregated: the actor's and the learner's)
    for i, (_, leaf) in enumerate(leaves):
        devices = tuple(sorted(d.id for d in leaf.sharding.device_set)) if isinstance(leaf, jax.Array) else ()
        groups.setdefault(devices, []).append(i)
    values: list[Any] = [None] * len(leaves)
    for members in groups.values():
        for i, value in zip(members, _digests([leaves[i][1] for i in members])):
            values[i] = value
    return {leaf_name(path): "".join(f"{int(w):08x}" for w in np.asarray(_local(value)))
            for (path, _), value in zip(leaves, values)}


def _local(value: jax.Array) -> Any:
    """A replicated result's value as this process holds it (all of it, on any of its devices)."""
    return value.addressable_data(0) if isinstance(value, jax.Array) else value


def checksums(tree: Any) -> dict:
    """What is saved beside `tree` (a checkpoint's meta, the warm-start cache's entry) for
    `unmatched` to check it against when it is read back."""
    return {"algorithm": CHECKSUM_ALGORITHM, "leaves": digests(tree)}


def unmatched(tree: Any, sums: dict, where: str) -> Optional[str]:
    """The line naming the first array of `tree` (read back from `where`) whose checksum is not in
    `checksums`' record `sums`; None where every one matches."""
    bad = mismatches(tree, sums["leaves"])
    if not bad:
        return None
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return f"{where}: array {bad[0]}{more} does not match the checksum saved with it (changed since it was written)"


def mismatches(tree: Any, expected: dict[str, str]) -> list[str]:
    """The names of the leaves of `tree` whose digest is not the one in `expected` (leaves that
    `expected` does not name are not checked: a tree restored in part)."""
    actual = digests(tree)
    return [name for name, digest in actual.items() if name in expected and expected[name] != digest]
