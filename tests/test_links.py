"""Control lanes over real loopback sockets: handshake verdicts, ordering, dead peers."""

import socket
import threading
import time

import pytest

from stage_worker.batch import RecordFlag, SequenceRecord
from stage_worker.transport import wire
from stage_worker.transport.handshake import StageIdentity, check_predecessor
from stage_worker.transport.links import InboundLink, LinkError, OutboundLink, RingWatchdog
from stage_worker.transport.wire import FrameKind


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _identity(rank, world=3, layers=(0, 10), **overrides):
    base = dict(rank=rank, world=world, replica=0, layers=layers, num_layers=30, hidden_size=576,
                wire_dtype="float32", fingerprint="abc")
    base.update(overrides)
    return StageIdentity(**base)


def test_handshake_rule_accepts_the_true_predecessor():
    me = _identity(1, layers=(10, 20))
    assert check_predecessor(me, _identity(0, layers=(0, 10)).to_body()) is None
    # the first stage's predecessor is the last stage, which must end at the last layer
    assert check_predecessor(_identity(0), _identity(2, layers=(20, 30)).to_body()) is None


@pytest.mark.parametrize(
    "peer,reason",
    [
        (_identity(0, layers=(0, 9)), "gap or overlap"),
        (_identity(2, layers=(0, 10)), "expected rank 0"),
        (_identity(0, hidden_size=960), "hidden size 960"),
        (_identity(0, wire_dtype="float16"), "same --dtype"),
        (_identity(0, fingerprint="zzz"), "different model"),
        (_identity(0, world=2), "pipeline of 2 stages"),
    ],
)
def test_handshake_rule_names_the_mismatch(peer, reason):
    assert reason in check_predecessor(_identity(1, layers=(10, 20)), peer.to_body())


def _pair(verdict=lambda body: None):
    port = _free_port()
    inbound = InboundLink(None, 0, "stage 0")
    inbound.listen("127.0.0.1", port)
    result = {}

    def accept():
        try:
            result["body"] = inbound.accept(5, verdict)
        except Exception as exc:  # the test inspects it
            result["error"] = exc

    thread = threading.Thread(target=accept)
    thread.start()
    outbound = OutboundLink(None, 1, "stage 1")
    outbound.connect("127.0.0.1", port, 5)
    return inbound, outbound, thread, result


def test_messages_arrive_in_order_with_their_records():
    inbound, outbound, thread, result = _pair()
    outbound.handshake({"hello": 1}, 5)
    thread.join()
    assert result["body"] == {"hello": 1}
    records = [SequenceRecord(3, 0, 0, RecordFlag.RELEASE)]
    outbound.send(FrameKind.FORWARD, records, batch_id=9)
    outbound.send(FrameKind.SHUTDOWN)
    first, second = inbound.recv(), inbound.recv()
    assert first.kind == FrameKind.FORWARD and first.records == tuple(records) and first.header.batch_id == 9
    assert first.payload is None
    assert second.kind == FrameKind.SHUTDOWN
    inbound.close()
    outbound.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_lane_payloads_arrive_bit_exact_after_their_header(dtype):
    import mlx.core as mx

    from stage_worker.transport.links import RingWatchdog

    inbound, outbound, thread, result = _pair()
    outbound.handshake({"hello": 1}, 5)
    thread.join()
    inbound.attach_lane_payloads()
    outbound.attach_lane_payloads(RingWatchdog(5, "test"))
    # a prefill-sized payload (megabytes: more than one socket buffer) and a decode-sized one
    big = (mx.random.normal((700, 1024)) * 3).astype(getattr(mx, dtype))
    small = mx.array([[1.5, -2.25, 3.0]], dtype=getattr(mx, dtype))
    records = [SequenceRecord(1, 0, 700, RecordFlag.NEW_SEQUENCE)]
    received = []
    def read() -> None:  # MLX evaluates an array on the thread that made it: compare there too
        for expected in (big, None, small):
            message = inbound.recv()
            received.append((message, None if expected is None else mx.array_equal(message.payload, expected).item()))

    reader = threading.Thread(target=read)
    reader.start()
    outbound.send(FrameKind.FORWARD, records, big, batch_id=1)
    outbound.send(FrameKind.TOKENS, [SequenceRecord(1, 700, 1)], mx.array([42], dtype=mx.int32), batch_id=1)
    outbound.send(FrameKind.FORWARD, [SequenceRecord(1, 700, 1)], small, batch_id=2)
    reader.join(10)
    (forward, big_equal), (tokens, _), (decode, small_equal) = received
    assert forward.records == tuple(records) and forward.payload.dtype == big.dtype and big_equal
    assert tokens.header.num_rows == 1 and decode.header.batch_id == 2 and small_equal
    inbound.close()
    outbound.close()


def test_a_transport_mismatch_is_refused_in_the_handshake():
    me = _identity(1, layers=(10, 20), hop_transport="lane")
    assert "--hop-transport" in check_predecessor(me, _identity(0, hop_transport="ring").to_body())


def test_refusal_reaches_both_sides():
    inbound, outbound, thread, result = _pair(lambda body: "peer loaded a different model")
    with pytest.raises(LinkError, match="refused this stage: peer loaded a different model"):
        outbound.handshake({"x": 1}, 5)
    thread.join()
    assert "different model" in str(result["error"])


def test_a_peer_that_dies_is_reported_at_once_not_waited_for():
    inbound, outbound, thread, _ = _pair()
    outbound.handshake({}, 5)
    thread.join()
    outbound.close()  # the kernel does the same when a process dies
    started = time.monotonic()
    with pytest.raises(LinkError, match="closed its control lane"):
        inbound.recv()
    assert time.monotonic() - started < 1


def test_unreachable_successor_fails_within_the_deadline():
    outbound = OutboundLink(None, 1, "stage 1")
    started = time.monotonic()
    with pytest.raises(LinkError, match="could not reach stage 1"):
        outbound.connect("127.0.0.1", _free_port(), 1.0)
    assert time.monotonic() - started < 3


def test_a_header_the_stage_cannot_consume_is_refused_before_any_ring_receive():
    inbound, outbound, thread, _ = _pair()
    outbound.handshake({}, 5)
    thread.join()
    # Frame claims a payload; the check refuses it before the (absent) ring is touched.
    header = wire.FrameHeader(FrameKind.FORWARD, 1, 0, 0, 4, 960, wire.code_dtype(2))
    outbound._require_sock().sendall(wire.pack_header(header))

    def check(h):
        import mlx.core as mx
        wire.check_forward_header(h, hidden_size=576, wire_dtype=mx.float32, sender="stage 0")

    with pytest.raises(wire.WireMismatchError, match="width 960"):
        inbound.recv(check=check)


def test_an_announced_header_arrives_before_its_payload_which_lands_in_the_given_buffer():
    import mlx.core as mx
    import numpy as np

    from stage_worker.transport.build_ahead import Placeholder
    from stage_worker.transport.links import RingWatchdog

    inbound, outbound, thread, _ = _pair()
    outbound.handshake({"hello": 1}, 5)
    thread.join()
    inbound.attach_lane_payloads()
    outbound.attach_lane_payloads(RingWatchdog(5, "test"))
    records = [SequenceRecord(3, 0, 2, RecordFlag.NEW_SEQUENCE)]
    outbound.announce(FrameKind.FORWARD, records, 2, 3, mx.bfloat16, batch_id=7, body={"k": 1}, in_flight=2)
    with pytest.raises(RuntimeError, match="must be sent before another message"):
        outbound.send(FrameKind.SHUTDOWN)
    head = inbound.recv_head()  # the payload has not been sent yet: the header is readable on its own
    assert head.records == tuple(records) and head.body == {"k": 1} and head.payload is None
    assert head.header.payload_shape == (2, 3) and head.header.in_flight == 2 and head.header.batch_id == 7
    placeholder = Placeholder(head.header.payload_shape, mx.bfloat16)
    doubled = placeholder.array * 2  # built before the bytes are there
    payload = mx.array([[1.5, -2.0, 0.25], [4.0, 8.0, -0.5]], dtype=mx.bfloat16)
    outbound.send_announced(payload)
    inbound.recv_payload_into(head.header, placeholder.writable())
    assert np.array(doubled.astype(mx.float32)).tolist() == [[3.0, -4.0, 0.5], [8.0, 16.0, -1.0]]
    outbound.announce(FrameKind.FORWARD, records, 2, 3, mx.bfloat16, batch_id=8)
    with pytest.raises(wire.WireMismatchError, match="announced 12 payload bytes"):
        outbound.send_announced(mx.zeros((1, 3), dtype=mx.bfloat16))
    inbound.close()
    outbound.close()


def test_a_closed_watchdog_ends_its_thread():
    before = sum(t.name == "ring-watchdog" for t in threading.enumerate())
    watchdog = RingWatchdog(5, "test")
    assert sum(t.name == "ring-watchdog" for t in threading.enumerate()) == before + 1
    watchdog.close()
    assert sum(t.name == "ring-watchdog" for t in threading.enumerate()) == before
