"""The checkpoint checksums (jaxreplay.train.checkpoint.digests): the same digest however an array is
sharded, and a different one for any changed word, in any dtype a checkpoint holds."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import cpu_devices_env
from jaxreplay.train.checkpoint import digests, mismatches

def tree():
    x = jax.random.normal(jax.random.key(0), (16, 8))
    return {"params": {"w": x, "half": x.astype(jnp.bfloat16)},
            "opt_state": [jnp.arange(7, dtype=jnp.int32), (x > 0)], "bytes": (x * 9).astype(jnp.uint8),
            "empty": jnp.zeros((0, 3)), "key": jax.random.key(1)}


def test_digests_name_every_leaf_by_its_path_and_repeat_exactly():
    first = digests(tree())
    assert set(first) == {"params/w", "params/half", "opt_state/0", "opt_state/1", "bytes", "empty", "key"}
    assert all(len(d) == 16 for d in first.values())
    assert digests(tree()) == first


def flip_one_bit(array: jax.Array, index: int) -> jax.Array:
    """`array` with the lowest bit of element `index` (flat) flipped."""
    a = np.array(array)
    flat = a.reshape(-1)
    if a.dtype == bool:
        flat[index] = not flat[index]
    else:
        flat.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])[index] ^= 1
    return jnp.asarray(a)


LEAVES = {"params/w": ("params", "w"), "params/half": ("params", "half"), "opt_state/0": ("opt_state", 0),
          "opt_state/1": ("opt_state", 1), "bytes": (None, "bytes")}


@pytest.mark.parametrize("leaf", list(LEAVES))
def test_any_single_changed_element_changes_its_leafs_digest_and_no_other(leaf):
    expected = digests(tree())
    outer, inner = LEAVES[leaf]
    for index in np.random.default_rng(0).choice(tree()[outer][inner].size if outer else tree()[inner].size, 10):
        t = tree()
        holder = t[outer] if outer else t
        holder[inner] = flip_one_bit(holder[inner], int(index))
        assert mismatches(t, expected) == [leaf]


def test_swapped_rows_change_the_digest():
    x = jax.random.normal(jax.random.key(0), (16, 8))
    swapped = x.at[jnp.array([0, 1])].set(x[jnp.array([1, 0])])
    assert digests({"x": x}) != digests({"x": swapped})


def test_the_digest_is_the_same_however_the_array_is_sharded():
    """On 2 CPU devices (a process of its own): whole, by rows, by columns."""
    script = """
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxreplay.train.checkpoint import digests
x = jax.random.normal(jax.random.key(0), (16, 8))
mesh = Mesh(np.array(jax.devices()[:2]), ("a",))
ways = [x, jax.device_put(x, NamedSharding(mesh, P("a", None))), jax.device_put(x, NamedSharding(mesh, P(None, "a")))]
print(len({digests({"x": w})["x"] for w in ways}), len(jax.devices()))
"""
    done = subprocess.run([sys.executable, "-c", script], env=cpu_devices_env(2), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "2"]
