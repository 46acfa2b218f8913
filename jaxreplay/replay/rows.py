"""Each rollout row stored as one flat byte string: a Reverb item of one tensor.

Reverb's per-item cost grows with the number of tensors in it (each is appended,
referenced, chunked, sent and decoded on its own), and a rollout row has seven small
fields. Packed into one uint8 vector, inserting and sampling a row costs half as much
(see benchmarks/replay.py). The layout is the item spec's fields in sorted-key order,
each as its native little-endian bytes; `RowLayout.describe()` spells it out, and
the table signature carries that text, so a Reverb checkpoint restored under another
layout is refused rather than misread.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

# name -> (per-item shape, dtype), as tables.ItemSpec
ItemSpec = Mapping[str, tuple[tuple[int, ...], np.dtype]]


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int  # bytes from the start of the row
    nbytes: int


class RowLayout:
    """Where each field of an `ItemSpec` row lives in its packed bytes."""

    def __init__(self, item_spec: ItemSpec):
        fields, offset = [], 0
        for name in sorted(item_spec):
            shape, dtype = item_spec[name]
            dtype = np.dtype(dtype).newbyteorder("<")
            nbytes = math.prod(shape) * dtype.itemsize
            fields.append(Field(name, tuple(shape), dtype, offset, nbytes))
            offset += nbytes
        self.fields: tuple[Field, ...] = tuple(fields)
        self.nbytes = offset

    def describe(self) -> str:
        """The layout as text, e.g. "advantage:<f4[];tokens:<i4[16]"."""
        return ";".join(f"{f.name}:{f.dtype.str}{list(f.shape)}".replace(" ", "") for f in self.fields)

    def pack(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        """[n, nbytes] uint8 from fields [n, *shape] (already checked against the spec)."""
        n = len(next(iter(arrays.values())))
        parts = [np.ascontiguousarray(arrays[f.name], f.dtype).reshape(n, -1).view(np.uint8) for f in self.fields]
        return np.concatenate(parts, axis=1)

    def unpack(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Fields [n, *shape] from packed rows [n, nbytes]; each field its own aligned array."""
        n = len(rows)
        return {f.name: np.ascontiguousarray(rows[:, f.offset:f.offset + f.nbytes]).view(f.dtype)
                .reshape(n, *f.shape).astype(f.dtype.newbyteorder("="), copy=False) for f in self.fields}
