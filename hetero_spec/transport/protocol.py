"""Wire protocol between the target process and the draft worker. The one place the frame layout lives.

A message is one ZeroMQ multipart message. Frame 0 is the header: a msgspec Struct, msgpack-encoded, tagged by its
class (field "t"). Frames 1..n are raw arrays, C-contiguous little-endian bytes, whose dtype and shape are in
header.arrays, in order. No pickle. Arrays of COPY_THRESHOLD bytes or more are sent zero-copy; smaller ones are
copied (faster below tens of kB). Sizes are bounded before anything is allocated (ARRAY_SCHEMA, MAX_DIM, the sockets'
MAXMSGSIZE); anything that does not fit is a `MalformedMessage`, which the receiver drops, counts and logs. Each
message's fields and arrays, and the rules, are tabled in docs/architecture.md#the-wire.
"""

import math
from typing import Union

import msgspec
import numpy as np

COPY_THRESHOLD = 64 * 1024
MAX_DIM = 1 << 24  # no dimension of any array we send comes near 16M entries
_DTYPES = {"int32": np.int32, "int64": np.int64, "float32": np.float32, "float16": np.float16}


class MalformedMessage(Exception):
    """A received message that does not follow this protocol."""


class ArrayMeta(msgspec.Struct, frozen=True):
    dtype: str
    shape: list[int]


class _Msg(msgspec.Struct, tag_field="t", kw_only=True):
    arrays: list[ArrayMeta] = []


class _RequestMsg(_Msg):
    """A message about one request's stream (req_id comes first on the wire)."""

    req_id: int


class Begin(_RequestMsg, tag="begin"):
    temperature: float
    top_k: int
    top_p: float
    seed: int
    gamma: int
    max_ahead: int
    drafting: bool = True
    coupled: bool = False  # coupled sampling: draft argmax(log q + g), no q on the wire


class Sync(_RequestMsg, tag="sync"):
    pos: int
    epoch: int


class Control(_RequestMsg, tag="control"):
    drafting: bool
    gamma: int


class End(_RequestMsg, tag="end"):
    pass


class Ping(_Msg, tag="ping"):
    seq: int
    sent: float


class Shutdown(_Msg, tag="shutdown"):
    pass


class Ready(_Msg, tag="ready"):
    pid: int
    vocab_width: int
    context_len: int
    providers: list[str]  # the draft session's, the one it runs on first
    fallback: list[str] = []  # fallbacks to the CPU provider its providers allowed and took


class Proposal(_RequestMsg, tag="proposal"):
    epoch: int          # the stream; the target drops stale ones (a Sync rebases the worker's stream, a new epoch)
    base: int           # the stream's first position drafted by the worker (before it: committed tokens)
    start: int          # absolute position of the first token: ids [k] int32 (+ q [k, vocab] float32 if sampled)
    draft_s: float      # worker time spent drafting the last `timed` of these tokens
    draft_t0: float     # time.monotonic() when drafting them began (system-wide clock on Linux)
    sent: float         # time.monotonic() at send
    timed: int = 0      # tokens that draft_s covers (the others were sent before)


class Pong(_Msg, tag="pong"):
    seq: int
    sent: float
    pid: int
    dropped: int = 0    # malformed messages the worker has dropped so far


class Failure(_Msg, tag="failure"):
    error: str


# per message type: the arrays it carries, (dtype, ndim) in order; `optional` trailing ones may be absent
ARRAY_SCHEMA: dict[type, tuple[list[tuple[str, int]], int]] = {
    Begin: ([("int32", 1)], 0),
    Sync: ([("int32", 1)], 0),
    Proposal: ([("int32", 1), ("float32", 2)], 1),
}

Message = Union[Begin, Sync, Control, End, Ping, Shutdown, Ready, Proposal, Pong, Failure]
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


def ids_within(ids: np.ndarray, vocab: int) -> bool:
    """Whether every token id indexes a vocabulary `vocab` wide: the receiver's check, as only it knows vocab."""
    return not ids.size or (int(ids.min()) >= 0 and int(ids.max()) < vocab)


def encode(msg: _Msg, arrays: tuple[np.ndarray, ...] = ()) -> list:
    """Message + arrays -> list of frames (header bytes, then array buffers)."""
    contiguous = [np.ascontiguousarray(a) for a in arrays]
    if unsendable := [a.dtype for a in contiguous if a.dtype.name not in _DTYPES]:
        raise TypeError(f"dtype {unsendable[0]} cannot go on the wire")
    msg.arrays = [ArrayMeta(a.dtype.name, list(a.shape)) for a in contiguous]
    return [_ENCODER.encode(msg), *contiguous]


def decode(frames: list) -> tuple[_Msg, list[np.ndarray]]:
    """Frames -> (message, arrays). Raises MalformedMessage on anything that does not fit."""
    if not frames:
        raise MalformedMessage("empty message")
    try:
        msg = _DECODER.decode(frames[0])  # a zmq.Frame (copy=False) or bytes: either is a buffer
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedMessage(f"bad header: {exc}") from None
    name = type(msg).__name__
    if len(frames) - 1 != len(msg.arrays):
        raise MalformedMessage(f"{name}: header names {len(msg.arrays)} arrays, got {len(frames) - 1} frames")
    schema, optional = ARRAY_SCHEMA.get(type(msg), ([], 0))
    if not len(schema) - optional <= len(msg.arrays) <= len(schema):
        raise MalformedMessage(f"{name} carries {len(msg.arrays)} arrays; expected "
                               f"{len(schema) - optional}..{len(schema)}")
    arrays = []
    for meta, frame, (want_dtype, want_ndim) in zip(msg.arrays, frames[1:], schema):
        if meta.dtype != want_dtype or len(meta.shape) != want_ndim:
            raise MalformedMessage(f"bad array meta {meta} in {name}: expected {want_dtype}, {want_ndim}-D")
        if any(not 0 <= d <= MAX_DIM for d in meta.shape):
            raise MalformedMessage(f"bad array meta {meta} in {name}: dimensions must be in [0, {MAX_DIM}]")
        buf = memoryview(frame)
        # Python ints: no overflow, and at most MAX_DIM ** ndim
        if buf.nbytes != math.prod(meta.shape) * np.dtype(_DTYPES[want_dtype]).itemsize:
            raise MalformedMessage(f"array frame of {buf.nbytes} bytes does not match {meta}")
        arrays.append(np.frombuffer(buf, dtype=_DTYPES[want_dtype]).reshape(meta.shape))
    if isinstance(msg, Proposal) and len(arrays) == 2 and arrays[1].shape[0] != arrays[0].shape[0]:
        raise MalformedMessage(f"Proposal with {arrays[0].shape[0]} tokens but {arrays[1].shape[0]} distributions")
    return msg, arrays
