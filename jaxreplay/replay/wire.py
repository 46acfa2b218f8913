"""Messages between the trainer and the Reverb sidecar: a JSON header and raw array bytes.

Never pickles: a socket that unpickles runs whatever it is sent. Each message is an
8-byte big-endian pair (header length, payload length), the UTF-8 JSON header, then
each array's bytes in the order the header lists them as [name, dtype, shape]. Only
numeric and bool dtypes cross; anything else is refused on both sides.
"""

from __future__ import annotations

import json
import math
import select
import socket
import struct
import time
from typing import Any, Callable, Mapping, Optional

import numpy as np

_PREFIX = struct.Struct("!II")
MAX_HEADER = 1 << 20
MAX_PAYLOAD = 1 << 31  # a sampled batch of long rows stays far below this
CONTROL_BYTES = 1 << 16  # a message before the table's layout is known: a header, no rows
_KINDS = "biuf"  # bool, signed, unsigned, float


class WireError(ConnectionError):
    """The peer closed the connection or sent something that is not a message."""


class TooLarge(WireError):
    """A message declared more bytes than its reader allows; none of them were read."""


def encode(header: Mapping[str, Any], arrays: Optional[Mapping[str, np.ndarray]] = None) -> list[bytes]:
    """`header` and `arrays` as the byte strings of one message."""
    listed, blobs = [], []
    for name, array in (arrays or {}).items():
        array = np.ascontiguousarray(array)
        if array.dtype.kind not in _KINDS:
            raise TypeError(f"wire: array {name!r} has dtype {array.dtype}; only numeric and bool arrays cross")
        listed.append([name, array.dtype.str, list(array.shape)])
        blobs.append(array.tobytes())
    head = json.dumps({**header, "arrays": listed}).encode()
    return [_PREFIX.pack(len(head), sum(map(len, blobs))), head, *blobs]


def send(sock: socket.socket, header: Mapping[str, Any], arrays: Optional[Mapping[str, np.ndarray]] = None) -> None:
    sock.sendall(b"".join(encode(header, arrays)))


def recv(sock: socket.socket, deadline: Optional[float] = None,
         waiting: Optional[Callable[[], None]] = None, slice_s: float = 0.1,
         limits: tuple[int, int] = (MAX_HEADER, MAX_PAYLOAD)) -> tuple[dict, dict[str, np.ndarray]]:
    """One message. Waits in `slice_s` slices, calling `waiting()` after each empty one (it
    may raise); past `deadline` (monotonic), `TimeoutError`. A message whose header or payload
    declares more than `limits` (bytes) is `TooLarge`, refused before anything is allocated for it."""
    head_len, payload_len = _PREFIX.unpack(_read(sock, _PREFIX.size, deadline, waiting, slice_s))
    if head_len > limits[0] or payload_len > limits[1]:
        raise TooLarge(f"a message of {head_len} + {payload_len} bytes (header + arrays), past this "
                       f"connection's limit of {limits[0]} + {limits[1]}")
    header = json.loads(_read(sock, head_len, deadline, waiting, slice_s))
    payload = memoryview(_read(sock, payload_len, deadline, waiting, slice_s))
    arrays, offset = {}, 0
    for name, dtype, shape in header.pop("arrays", []):
        dtype = np.dtype(dtype)
        if dtype.kind not in _KINDS:
            raise WireError(f"wire: array {name!r} has dtype {dtype}; only numeric and bool arrays cross")
        nbytes = math.prod(shape) * dtype.itemsize
        if offset + nbytes > payload_len:
            raise WireError(f"wire: array {name!r} runs past its message")
        arrays[name] = np.frombuffer(payload[offset:offset + nbytes], dtype).reshape(shape)
        offset += nbytes
    if offset != payload_len:
        raise WireError("wire: a message's payload is longer than its arrays")
    return header, arrays


def readable(sock: socket.socket) -> bool:
    """Whether a message (or the peer's close) is waiting, without taking it."""
    return bool(select.select([sock], [], [], 0)[0])


def _read(sock: socket.socket, n: int, deadline: Optional[float], waiting, slice_s: float) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        wait = slice_s if deadline is None else min(slice_s, deadline - time.monotonic())
        if wait <= 0:
            raise TimeoutError("wire: no answer in time")
        if not select.select([sock], [], [], wait)[0]:
            if waiting is not None:
                waiting()
            continue
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireError("wire: the peer closed the connection")
        got += k
    return buf
