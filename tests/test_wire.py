"""Wire layout: headers and records survive a round trip; bad frames are named, not guessed."""

import struct

import mlx.core as mx
import pytest

from stage_worker.batch import RecordFlag, SequenceRecord
from stage_worker.transport import wire
from stage_worker.transport.wire import FrameHeader, FrameKind
from stagemesh_core.sampling import SamplingParams


def test_header_round_trip():
    header = FrameHeader(FrameKind.FORWARD, message_no=7, batch_id=3, num_records=2, num_rows=5,
                         row_width=576, dtype=mx.bfloat16, in_flight=2)
    data = wire.pack_header(header)
    assert len(data) == wire.HEADER_BYTES
    assert wire.unpack_header(data) == header
    assert header.payload_shape == (5, 576)


def test_tokens_payload_is_one_dimensional():
    header = FrameHeader(FrameKind.TOKENS, 0, 1, 3, 3, 1, mx.int32)
    assert header.payload_shape == (3,)


def test_records_round_trip_with_flags_and_sampling():
    records = (
        SequenceRecord(1, 0, 12, RecordFlag.NEW_SEQUENCE | RecordFlag.SAMPLE, SamplingParams(0.7, 0.9, 40, 1234)),
        SequenceRecord(2**40, 99, 1, RecordFlag.SAMPLE | RecordFlag.RELEASE),
        SequenceRecord(5, 7, 0, RecordFlag.RELEASE),
        SequenceRecord(6, 16, 4, RecordFlag.NEW_SEQUENCE, prefix_entry=2**32 - 1),
        SequenceRecord(7, 32, 0, RecordFlag.RELEASE | RecordFlag.RETAIN, prefix_entry=3),
        SequenceRecord(0, 0, 0, RecordFlag.EVICT, prefix_entry=4),
    )
    data = wire.pack_records(records)
    assert len(data) == 6 * wire.RECORD_BYTES
    decoded = wire.unpack_records(data, 6)
    assert decoded[1:] == records[1:]
    first = decoded[0]
    assert first.has(RecordFlag.NEW_SEQUENCE) and first.has(RecordFlag.SAMPLE) and not first.has(RecordFlag.RELEASE)
    assert first.sampling.top_k == 40 and first.sampling.seed == 1234
    assert first.sampling.temperature == pytest.approx(0.7) and first.sampling.top_p == pytest.approx(0.9)
    assert wire.total_rows(records) == 17


def test_a_record_carries_the_samplers_four_fields_and_the_rest_travels_in_row_options():
    sampling = SamplingParams(temperature=0.5, top_p=0.8, top_k=3, seed=None, presence_penalty=1.0, min_p=0.2)
    (decoded,) = wire.unpack_records(wire.pack_records([SequenceRecord(1, 0, 1, RecordFlag.SAMPLE, sampling)]), 1)
    assert decoded.sampling.seed is None and decoded.sampling.top_k == 3
    assert decoded.sampling.presence_penalty == 0.0 and decoded.sampling.min_p == 0.0  # RowOptions' part


def test_garbage_and_foreign_versions_are_refused():
    with pytest.raises(wire.WireMismatchError, match="not a stagemesh stage"):
        wire.unpack_header(b"\0" * wire.HEADER_BYTES)
    data = bytearray(wire.pack_header(FrameHeader(FrameKind.SHUTDOWN, 0, 0, 0, 0, 0, None)))
    struct.pack_into("<H", data, 4, 99)
    with pytest.raises(wire.WireMismatchError, match="protocol v99"):
        wire.unpack_header(bytes(data))


def test_forward_header_check_names_widths_and_dtypes():
    header = FrameHeader(FrameKind.FORWARD, 0, 0, 1, 4, 960, mx.float16)
    with pytest.raises(wire.WireMismatchError, match="width 960 in float16.*width 576 in float32"):
        wire.check_forward_header(header, hidden_size=576, wire_dtype=mx.float32, sender="stage 0")
    wire.check_forward_header(header, hidden_size=960, wire_dtype=mx.float16, sender="stage 0")


def test_the_architecture_doc_gives_the_frame_sizes_the_code_has():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    assert f"fixed {wire.HEADER_BYTES}-byte header and fixed {wire.RECORD_BYTES}-byte per-sequence" in \
        " ".join(doc.split())
