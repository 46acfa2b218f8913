"""Packed rows (replay/rows.py): every field comes back bit for bit, whatever its offset."""

from __future__ import annotations

import numpy as np

from jaxreplay.replay.rows import RowLayout

SPEC = {  # sorted: a bool field first puts every later field at an odd byte offset
    "a_flag": ((3,), np.bool_),
    "logprobs": ((4,), np.float32),
    "tokens": ((4,), np.int32),
    "value": ((), np.float64),
    "version": ((), np.int32),
}


def test_pack_then_unpack_gives_back_every_field_exactly():
    rng = np.random.default_rng(0)
    n = 5
    batch = {
        "a_flag": rng.random((n, 3)) < 0.5,
        "logprobs": np.array(rng.standard_normal((n, 4)), np.float32),
        "tokens": rng.integers(-2**31, 2**31 - 1, (n, 4), dtype=np.int32),
        "value": np.array([np.nan, -0.0, np.inf, 1e-300, 3.5]),
        "version": np.arange(n, dtype=np.int32),
    }
    layout = RowLayout(SPEC)
    rows = layout.pack(batch)
    assert rows.dtype == np.uint8 and rows.shape == (n, 3 + 16 + 16 + 8 + 4) == (n, layout.nbytes)
    out = layout.unpack(rows)
    assert set(out) == set(SPEC)
    for k, a in batch.items():
        assert out[k].dtype == a.dtype and out[k].shape == a.shape
        assert out[k].tobytes() == a.tobytes(), k  # bit for bit: NaN and -0.0 included


def test_rows_are_independent_of_each_other():
    layout = RowLayout(SPEC)
    batch = {k: np.zeros((2, *shape), dtype) for k, (shape, dtype) in SPEC.items()}
    batch["tokens"][1] = 7
    rows = layout.pack(batch)
    assert layout.unpack(rows[:1])["tokens"].tolist() == [[0, 0, 0, 0]]
    assert layout.unpack(rows[1:])["tokens"].tolist() == [[7, 7, 7, 7]]


def test_describe_names_every_field_with_its_dtype_and_shape():
    assert RowLayout(SPEC).describe() == "a_flag:|b1[3];logprobs:<f4[4];tokens:<i4[4];value:<f8[];version:<i4[]"
