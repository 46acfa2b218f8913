"""Orbax checkpoints of the learner, tied to the Reverb checkpoint taken with them.

A checkpoint is one Orbax step holding two items: `state` (params, optimizer
state, RNG key) and `meta` (counters, the path of the Reverb checkpoint taken
just before, so a resume restores exactly that buffer, never a newer orphan, and
the run-changing settings the step was trained with, which a resume is checked
against even where config.yaml is gone or edited).
Orbax finalises a step by an atomic rename, so a half-written one is never listed;
steps past `keep` are likewise renamed away before they are deleted, so a kill
mid-delete leaves no half-deleted step listed either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from jaxreplay import storage


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


class CheckpointError(ValueError):
    """A checkpoint that is missing, or that exists but cannot be read back."""


@contextlib.contextmanager
def _unreadable(directory: str | Path, step: int):
    """Orbax's many (often multi-line) errors for a damaged or mismatched step, as one line."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised with the step named
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"checkpoint step {step} in {directory} cannot be restored "
                              f"({type(e).__name__}: {first})") from e


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


_DELETED = ".deleted"  # steps past `keep` are renamed in here, then deleted
SETTINGS = "trained_with"  # meta's key for the run-changing settings; absent in steps written before it


class Checkpointer:
    def __init__(self, directory: Any, keep: int, timeout_s: Optional[float] = None,
                 settings: Optional[dict] = None):
        """`directory`: a local path or a bucket URL (either as `storage.orbax_path` gives it).
        `timeout_s`: how long Orbax's barriers between processes wait (`distributed.timeout_s`),
        instead of its own 20 minutes. `settings`: the run-changing settings each step records
        (recorder.run_settings); update it when they change (a calibrated ratio)."""
        self.settings = settings
        self.directory = storage.orbax_path(directory) if isinstance(directory, (str, os.PathLike)) else directory
        # A step killed mid-write stays a tmp directory, never listed, deleted on the next start. On a
        # bucket (no rename) steps past `keep` are deleted where they are.
        local = isinstance(self.directory, Path)
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
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave({**dataclasses.asdict(progress),
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
        """Restores onto the structure, shapes, dtypes and shardings of `state_like`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_like)
        with _unreadable(self.directory, step):
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()),
            )
            meta = dict(restored.meta)
            meta.pop(SETTINGS, None)
            return restored.state, Progress(**meta)

    def close(self) -> None:
        self._manager.close()


def save_params(path: str | Path, params: Any) -> None:
    """One-off params snapshot (the cached warm start)."""
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(storage.orbax_path(path), params, force=True)


def restore_params(path: str | Path, params_like: Any) -> Any:
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, params_like)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(storage.orbax_path(path), abstract)


def restore_policy_params(directory: str | Path, params_like: Any, step: Optional[int] = None) -> tuple[Any, int]:
    """(params, step) of a training checkpoint, read alone: evaluation needs neither the
    optimizer state nor the waiting rollouts. `params_like` may be abstract (shapes,
    dtypes, shardings); the default device is used where it has no sharding."""
    manager = ocp.CheckpointManager(storage.orbax_path(directory))
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
            restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=tree, restore_args=ocp.checkpoint_utils.construct_restore_args(tree), transforms={})))
            return restored.state["params"], step
    finally:
        manager.close()
