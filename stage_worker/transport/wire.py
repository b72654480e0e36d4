"""Wire layout between neighbouring stages: the one home of every byte offset.

Each hop from stage r to stage r+1 (and from the last stage back to the first) carries messages in order on
two lanes: the **control lane**, a TCP connection, carries a fixed-size ``FrameHeader`` (``HEADER_BYTES``),
``num_records`` fixed-size ``SequenceRecord`` entries (``RECORD_BYTES``) and an optional JSON body; the
**payload** the header announced (hidden states for ``FORWARD``, token ids for ``TOKENS``) travels by the
pipeline's hop transport (``HOP_TRANSPORTS``). Because the receiver sizes its receive from the header,
sender and receiver can never disagree on the byte count; a header that contradicts the receiver's own model
(hidden size, dtype, a gap in the message sequence) is reported as a ``WireMismatchError`` instead.

``pack_header`` / ``unpack_header``, ``pack_records`` / ``unpack_records``, ``encode_body`` / ``decode_body``
and ``payload_bytes`` / ``payload_from_bytes`` are the codecs. The records themselves (``SequenceRecord``,
``RecordFlag``) are ``stage_worker.batch``'s; their bytes are this module's.
"""

from __future__ import annotations

import enum
import functools
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from stage_worker.batch import RecordFlag, SequenceRecord, WireMismatchError
from stagemesh_core.sampling import SamplingParams

MAGIC = b"SMW1"
PROTOCOL_VERSION = 3  # every header carries it, and neighbours must speak the same one
# How a hop's payload travels: ``lane`` (the default) sends its raw bytes on the same TCP connection right
# after the header (``payload_bytes`` / ``payload_from_bytes``); ``ring`` hands it to MLX's ring, which pays
# for its own thread hand-offs and synchronisation on every hop (``stagemesh bench hop`` measures both). The
# lane also blocks in the kernel where a waiting ring receive spins a core.
HOP_TRANSPORTS = ("lane", "ring")


class FrameKind(enum.IntEnum):
    HELLO = 1  # start-up handshake, JSON body, no ring payload
    HELLO_REPLY = 2  # receiver's verdict on a HELLO, JSON body
    FORWARD = 3  # a micro-batch of hidden states moving down the pipeline
    TOKENS = 4  # sampled token ids, last stage -> first stage
    SHUTDOWN = 5  # stop after this message; travels the whole ring once
    CAPACITY = 6  # JSON body {"kv_tokens": n}: each stage lowers n to its own; travels the ring once


# dtype codes on the wire; the order is part of the protocol.
_DTYPE_CODES: dict[mx.Dtype, int] = {
    mx.float32: 1,
    mx.float16: 2,
    mx.bfloat16: 3,
    mx.int32: 4,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


def dtype_code(dtype: mx.Dtype) -> int:
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel on the wire") from None


def code_dtype(code: int) -> mx.Dtype:
    try:
        return _CODE_DTYPES[code]
    except KeyError:
        raise WireMismatchError(f"unknown wire dtype code {code}") from None


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


# NumPy has no bfloat16: its bits travel as uint16 and are viewed back on arrival.
_HOST_DTYPES: dict[mx.Dtype, tuple[type, mx.Dtype | None]] = {
    mx.float32: (np.float32, None),
    mx.float16: (np.float16, None),
    mx.bfloat16: (np.uint16, mx.uint16),
    mx.int32: (np.int32, None),
}


def host_dtype(dtype: mx.Dtype) -> tuple[type, mx.Dtype | None]:
    """NumPy's dtype for ``dtype``'s bytes on the wire, and the MLX dtype to view them as first (None: same)."""
    try:
        return _HOST_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel on the wire") from None


def payload_nbytes(header: FrameHeader) -> int:
    assert header.dtype is not None
    return math.prod(header.payload_shape) * header.dtype.size


def payload_bytes(array: mx.array) -> memoryview:
    """The array's bytes in host memory (evaluates it: the one device sync of a send)."""
    _, bits = host_dtype(array.dtype)
    host = np.asarray(array.view(bits) if bits is not None else array)
    # numpy's stubs declare ndarray's buffer protocol only for Python 3.12+; it has it on 3.11 too.
    return memoryview(np.ascontiguousarray(host)).cast("B")  # type: ignore[arg-type]


def payload_from_bytes(data: bytearray | memoryview, header: FrameHeader) -> mx.array:
    """The payload ``header`` announced, from the bytes that followed it on the lane."""
    assert header.dtype is not None
    numpy_dtype, bits = host_dtype(header.dtype)
    array = mx.array(np.frombuffer(data, dtype=numpy_dtype).reshape(header.payload_shape))
    return array.view(header.dtype) if bits is not None else array


# magic, version, kind, message_no, batch_id, num_records, num_rows, row_width,
# dtype code, body_bytes, in_flight (0: unknown)
_HEADER = struct.Struct("<4sHHQQIIIIII")
# seq_id, start_pos, num_tokens, flags, temperature, top_p, top_k, seed, prefix_entry (0: none)
_RECORD = struct.Struct("<QIIIffiqI")

HEADER_BYTES = _HEADER.size
RECORD_BYTES = _RECORD.size
NO_SEED = -1  # a record's seed when its sampling has none


@dataclass(frozen=True)
class FrameHeader:
    """What follows on the lane and the hop: a receiver blocks on the header in the kernel (no spinning) and
    learns the exact shape and dtype of the payload before it posts a ring receive, so the byte counts always
    agree (a disagreement would deadlock the tagless ring or desynchronise the lane). The payload: hidden
    states ``[num_rows, hidden_size]`` in the wire dtype for ``FORWARD``, token ids ``int32[num_rows]`` for
    ``TOKENS`` (each record's ids in turn), nothing for ``SHUTDOWN``."""

    kind: FrameKind
    message_no: int  # per-link counter: a gap means a lost or reordered message
    batch_id: int
    num_records: int
    num_rows: int  # payload rows on the ring (0: no payload)
    row_width: int  # hidden size for FORWARD, 1 for TOKENS
    dtype: mx.Dtype | None
    body_bytes: int = 0  # JSON body on the lane (HELLO / HELLO_REPLY)
    in_flight: int = 0  # FORWARD: batches in the pipeline when the entry sent this one (0: unknown)

    @property
    def payload_shape(self) -> tuple[int, ...]:
        if self.kind == FrameKind.TOKENS:
            return (self.num_rows,)
        return (self.num_rows, self.row_width)

    @property
    def has_payload(self) -> bool:
        return self.num_rows > 0 and self.dtype is not None


def pack_header(header: FrameHeader) -> bytes:
    return _HEADER.pack(
        MAGIC,
        PROTOCOL_VERSION,
        int(header.kind),
        header.message_no,
        header.batch_id,
        header.num_records,
        header.num_rows,
        header.row_width,
        0 if header.dtype is None else dtype_code(header.dtype),
        header.body_bytes,
        header.in_flight,
    )


def unpack_header(data: bytes) -> FrameHeader:
    (magic, version, kind, message_no, batch_id, num_records, num_rows, width,
     code, body_bytes, in_flight) = _HEADER.unpack(data)
    if magic != MAGIC:
        raise WireMismatchError(
            f"control lane frame starts with {magic!r}, not {MAGIC!r}: the peer is "
            f"not a stagemesh stage or the lane lost its framing"
        )
    if version != PROTOCOL_VERSION:
        raise WireMismatchError(
            f"peer speaks wire protocol v{version}, this stage v{PROTOCOL_VERSION}: "
            f"run the same stagemesh version on every node"
        )
    try:
        frame_kind = FrameKind(kind)
    except ValueError:
        raise WireMismatchError(f"unknown frame kind {kind}") from None
    return FrameHeader(
        kind=frame_kind,
        message_no=message_no,
        batch_id=batch_id,
        num_records=num_records,
        num_rows=num_rows,
        row_width=width,
        dtype=None if code == 0 else code_dtype(code),
        body_bytes=body_bytes,
        in_flight=in_flight,
    )


def pack_records(records: Sequence[SequenceRecord]) -> bytes:
    """A ``FORWARD`` batch holds many sequences: record i owns the payload rows ``[sum(n_0..n_{i-1}), +n_i)``
    and says where its tokens sit in the sequence (``start_pos``), whether it starts the sequence (reset KV),
    whether the last stage must sample a token for it, whether the sequence ends after this batch (free its
    KV), and the temperature, top_p, top_k and seed of its sampling."""
    return b"".join(
        _RECORD.pack(
            r.seq_id,
            r.start_pos,
            r.num_tokens,
            int(r.flags),
            r.sampling.temperature,
            r.sampling.top_p,
            r.sampling.top_k,
            NO_SEED if r.sampling.seed is None else r.sampling.seed,
            r.prefix_entry,
        )
        for r in records
    )


def unpack_records(data: bytes, count: int) -> tuple[SequenceRecord, ...]:
    records = []
    for i in range(count):
        (seq_id, start_pos, num_tokens, flags, temperature, top_p, top_k, seed,
         prefix_entry) = _RECORD.unpack_from(data, i * RECORD_BYTES)
        records.append(
            SequenceRecord(
                seq_id=seq_id,
                start_pos=start_pos,
                num_tokens=num_tokens,
                flags=RecordFlag(flags),
                sampling=_record_sampling(temperature, top_p, top_k, seed),
                prefix_entry=prefix_entry,
            )
        )
    return tuple(records)


@functools.lru_cache(maxsize=4096)
def _record_sampling(temperature: float, top_p: float, top_k: int, seed: int) -> SamplingParams:
    """A received record's sampling: the four fields the record carries, the rest at their defaults.
    Cached: a sequence's records repeat the same four values every step, so they share one value."""
    return SamplingParams(temperature, top_p, top_k, None if seed == NO_SEED else seed)


@dataclass(frozen=True)
class Message:
    """A whole message as a stage sees it: header, records, optional body and payload.

    ``HELLO`` frames carry a JSON body used once at start-up to check that neighbours agree; a ``FORWARD``
    frame's body announces the ``RowOptions`` of the sequences it starts (``row_options.rows_body``: once per
    sequence, only when a request has any; relays pass it on) and the draft ids of its VERIFY records
    (``speculation.drafts_body``); a ``TOKENS`` frame's body the logprobs of the tokens whose requests asked
    for them, one per token in order (``LogprobRows.to_body``)."""

    header: FrameHeader
    records: tuple[SequenceRecord, ...] = ()
    body: dict | None = None
    payload: mx.array | None = None

    @property
    def kind(self) -> FrameKind:
        return self.header.kind


def encode_body(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True).encode()


def decode_body(data: bytes) -> dict:
    try:
        return json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireMismatchError(f"malformed handshake body: {exc}") from None


def total_rows(records: Sequence[SequenceRecord]) -> int:
    return sum(r.num_tokens for r in records)


def check_forward_header(
    header: FrameHeader, *, hidden_size: int, wire_dtype: mx.Dtype, sender: str
) -> None:
    """Refuse a FORWARD payload this stage's model slice cannot consume."""
    if header.row_width != hidden_size or header.dtype != wire_dtype:
        got_dtype = "none" if header.dtype is None else dtype_name(header.dtype)
        raise WireMismatchError(
            f"{sender} sent hidden states of width {header.row_width} in {got_dtype}, "
            f"but this stage's model slice takes width {hidden_size} in "
            f"{dtype_name(wire_dtype)}: the stages loaded different models or compute "
            f"dtypes; start every stage of a pipeline from the same plan"
        )
