"""The rollout row: one completion with its prompt, as the actor writes it, the table
stores it, the reader returns it and the learner trains on it. The one list of fields.

A row is fixed at generation time: the behaviour log-probs, the frozen advantage and
the policy version that made it stay with it however often it is replayed.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxreplay.config import Config
from jaxreplay.models import moe

Rows = dict[str, np.ndarray]  # field -> [n, *shape]
RowSpec = Mapping[str, tuple[tuple[int, ...], np.dtype]]  # field -> (per-row shape, dtype)


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    per_token: bool  # [T] over prompt + completion; else one value per row
    dtype: type
    trained: bool  # the learner's update reads it
    doc: str


FIELDS = (
    Field("tokens", True, np.int32, True, "prompt then completion, right-padded"),
    Field("attention_mask", True, np.bool_, True, "real tokens of prompt and completion"),
    Field("completion_mask", True, np.bool_, True, "the completion's tokens: what the loss scores"),
    Field("logprobs", True, np.float32, True, "behaviour log-probs of each completion token at generation"),
    Field("advantage", False, np.float32, True, "frozen at generation from the group's rewards"),
    Field("reward", False, np.float32, False, "the task's reward"),
    Field("policy_version", False, np.int32, False, "the version of the weights that drew its first token "
          "(staleness counts from it)"),
    Field("last_version", False, np.int32, False, "the version of the weights that drew its last token "
          "(sampling.engine continuous only: weights change between decode chunks)"),
    Field("rollout_id", False, np.int32, False, "actor_step * R + the row's index in that step's prompt batch "
          "(every process's rows counted): one rollout's items in several tables share it"),
    Field("routes", True, np.int16, True, "a mixture of experts' only: [T, sparse layers, k], the experts each "
          "sparse layer sent each token to at generation, -1 where none ran"),
)
TRAINED = tuple(f.name for f in FIELDS if f.trained)
ROUTES = "routes"  # the one field that only some rows have (`records_routes`)


def row_spec(config: Config, prompt_len: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shape and dtype of one row: sequences of the prompt plus `sampling.max_new_tokens`."""
    t = prompt_len + config.sampling.max_new_tokens
    streaming = config.sampling.engine == "continuous"  # a static batch's rows have one version
    spec = {f.name: ((t,) if f.per_token else (), np.dtype(f.dtype)) for f in FIELDS
            if f.name not in ("last_version", ROUTES) or (streaming and f.name == "last_version")}
    if records_routes(config):
        spec[ROUTES] = ((t, len(moe.sparse_layers(config.model)), config.model.experts_per_token), np.dtype(np.int16))
    return spec


def records_routes(config: Config) -> bool:
    """Whether rows carry `routes`: a mixture of experts, whichever sampler made them (both record them)."""
    return bool(moe.sparse_layers(config.model))


def make_rows(spec: RowSpec, **fields: np.ndarray) -> Rows:
    """Rows with every field of `spec`, each cast to its dtype; a missing or extra field is an error."""
    if set(fields) != set(spec):
        raise ValueError(f"rollout rows need fields {sorted(spec)}, got {sorted(fields)}")
    return {name: np.asarray(fields[name], dtype) for name, (_, dtype) in spec.items()}


def count(rows: Optional[Rows]) -> int:
    return 0 if rows is None else len(rows["reward"])


def split(rows: Rows, n: int) -> tuple[Rows, Optional[Rows]]:
    """The first n rows, and the rest (None when nothing is left)."""
    head = {k: v[:n] for k, v in rows.items()}
    return head, ({k: v[n:] for k, v in rows.items()} if n < count(rows) else None)


def drop_flat_groups(rows: Rows, group_size: int) -> tuple[Optional[Rows], int]:
    """The rows of every group of `group_size` consecutive rows whose advantages are not all 0
    (None when none is left), and how many groups were dropped: a group that scored alike
    carries no gradient, and every sample of it would spend the limiter's budget on nothing."""
    flat = np.all(rows["advantage"].reshape(-1, group_size) == 0, axis=1)
    keep = np.repeat(~flat, group_size)
    return ({k: v[keep] for k, v in rows.items()} if keep.any() else None), int(flat.sum())


def padded(rows: Optional[Rows], spec: RowSpec, capacity: int) -> Rows:
    """`rows` zero-padded to `capacity`, with a `valid` flag per row: fixed shapes for a checkpoint."""
    n = count(rows)
    if n > capacity:
        raise ValueError(f"{n} rows do not fit a checkpoint slot of {capacity}")
    out = {"valid": np.arange(capacity) < n}
    for name, (shape, dtype) in spec.items():
        out[name] = np.zeros((capacity, *shape), dtype)
        if n:
            out[name][:n] = rows[name]
    return out


def unpadded(rows: Mapping[str, np.ndarray]) -> Optional[Rows]:
    """The valid rows of a `padded` slot (None when there are none)."""
    n = int(np.asarray(rows["valid"]).sum())
    return {k: np.asarray(v)[:n] for k, v in rows.items() if k != "valid"} if n else None


# Set by the learner's caller, not stored: each row's age (learner version minus `policy_version`), for the
# update's statistics by age (learn/staleness.py).
AGE = "age"


def trained(rows: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The fields the update reads, in their row dtypes, and each row's `AGE` where the caller gave it."""
    dtypes = {f.name: f.dtype for f in FIELDS}
    out = {name: np.asarray(rows[name], dtypes[name]) for name in TRAINED if name != ROUTES or ROUTES in rows}
    if AGE in rows:
        out[AGE] = np.asarray(rows[AGE], np.int32)
    return out


def to_device_batch(rows: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """The fields the update reads, as device arrays."""
    return {name: jnp.asarray(value) for name, value in trained(rows).items()}
