"""Per-array checksums of checkpointed state, computed on the device from the arrays themselves.

Orbax (through tensorstore) checks its own index and b-tree nodes, but not the array chunks:
bytes changed inside a chunk are restored silently. So a checkpoint records a 64-bit digest
of every leaf of what it saves, and a restore recomputes them on the arrays it read back,
before anything trains on them.

The digest is computed where the arrays live, in one jitted pass that reads each element once
(no second pass over the state on the host): each element's bits, as 32-bit words, are mixed
with its flat position by a bijective 32-bit hash (MurmurHash3's finaliser) and summed modulo
2**32, in two lanes with different constants. Integer addition is exact, so the sum is the
same however the array is sharded or the reduction ordered (a resharded restore agrees);
a bijection of a changed word always changes its term, so any single changed word, in any
leaf, changes the digest, and more changes cancel with odds of about 2**-64. It reads the
bits, not the values: a NaN written is a NaN expected.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ALGORITHM = "fmix32-sum-2x32/1"  # recorded with the digests: a later change of algorithm is not taken for damage

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
    return jnp.stack([jnp.sum(_fmix32(words + position * jnp.uint32(m) + jnp.uint32(c)), dtype=jnp.uint32)
                      for m, c in _LANES])


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


def mismatches(tree: Any, expected: dict[str, str]) -> list[str]:
    """The names of the leaves of `tree` whose digest is not the one in `expected` (leaves that
    `expected` does not name are not checked: a tree restored in part)."""
    actual = digests(tree)
    return [name for name, digest in actual.items() if name in expected and expected[name] != digest]
