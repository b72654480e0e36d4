"""Links between neighbouring stages: a TCP control lane, and the payload after it or on the MLX ring.

Stage r owns one ``InboundLink`` (from stage r-1, or from the last stage on the first) and one
``OutboundLink`` (to stage r+1, or to the first stage on the last). A message is its header and records on
the lane, then its payload: by default its raw bytes on the same lane (``hop_transport`` "lane"), or on MLX's
ring (``Ring``, "ring"); ``wire`` gives the layout. A neighbour that is gone or refuses raises ``LinkError``.
A payload transfer that outlives ``ring_timeout`` (a frozen peer) ends the process (``RingWatchdog``), so
whatever supervises it restarts the pipeline.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx

from stage_worker.transport import wire
from stagemesh_core.states import ExitCode

log = logging.getLogger(__name__)


class LinkError(RuntimeError):
    """A neighbour is gone or refused us; the pipeline cannot continue."""


class RingWatchdog:
    """Ends the process when one ring operation outlives its deadline; ``close`` ends its thread (a stage's lives
    as long as the process, a pipeline's in a test process ends with the pipeline).

    A payload transfer (ring operation, or a lane send blocked on a full socket buffer) that does not finish
    within ``ring_timeout`` (a frozen peer) cannot be interrupted from Python; exiting lets whatever supervises
    the process restart the pipeline.
    """

    def __init__(self, timeout_s: float, describe_stage: str) -> None:
        self._timeout_s = timeout_s
        self._stage = describe_stage
        self._lock = threading.Lock()
        self._started: float | None = None
        self._what = ""
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="ring-watchdog")
        self._thread.start()

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        with self._lock:
            self._started, self._what = time.monotonic(), what
        try:
            yield
        finally:
            with self._lock:
                self._started = None

    def close(self) -> None:
        self._closed.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._closed.wait(min(0.5, self._timeout_s / 4)):
            with self._lock:
                started, what = self._started, self._what
            if started is not None and time.monotonic() - started > self._timeout_s:
                # The blocked call cannot be interrupted; exit so the
                # supervisor replaces the whole pipeline.
                print(
                    f"{self._stage}: ring operation '{what}' did not finish within "
                    f"{self._timeout_s:.0f} s (peer frozen or unreachable); exiting",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(ExitCode.RING_TIMEOUT)


class Ring:
    """Evaluated point-to-point transfers on the MLX ring group, under the watchdog.

    Headers and records travel on the lane even with the ring, because of three facts of the ring:

    * a posted ring receive spins a CPU core until data arrives, so a stage waits for work in a blocking socket
      read on the lane and posts the ring receive only once the header says a payload is on its way;
    * ring messages carry no tags, so the receiver sizes its receive from the header and checks it against its
      own model first: no byte-count mismatch, no deadlock;
    * a dead peer is invisible to an idle ring (sends then silently lose data), but the kernel closes its lane
      socket, so the survivor learns at once.
    """

    def __init__(self, group: mx.distributed.Group, watchdog: RingWatchdog) -> None:
        self.group = group
        self._watchdog = watchdog

    def send(self, array: mx.array, dst: int) -> None:
        with self._watchdog.guard(f"send {tuple(array.shape)} to rank {dst}"):
            try:
                mx.eval(mx.distributed.send(array, dst, group=self.group))
            except RuntimeError as exc:
                raise LinkError(f"ring send to rank {dst} failed: {exc}") from exc

    def recv(self, shape: Sequence[int], dtype: mx.Dtype, src: int) -> mx.array:
        with self._watchdog.guard(f"recv {tuple(shape)} from rank {src}"):
            try:
                out = mx.distributed.recv(tuple(shape), dtype, src, group=self.group)
                mx.eval(out)
            except RuntimeError as exc:
                raise LinkError(f"ring receive from rank {src} failed: {exc}") from exc
        return out


def _recv_exact(sock: socket.socket, count: int, peer: str) -> bytes:
    chunks = bytearray()
    while len(chunks) < count:
        try:
            chunk = sock.recv(count - len(chunks))
        except TimeoutError:
            raise
        except OSError as exc:
            raise LinkError(f"control lane from {peer} failed: {exc}") from exc
        if not chunk:
            raise LinkError(f"{peer} closed its control lane (the stage exited or crashed)")
        chunks += chunk
    return bytes(chunks)


def recv_exactly_into(sock: socket.socket, buffer: bytearray | memoryview, peer: str) -> None:
    """Fill ``buffer`` from ``sock``; ``LinkError`` naming ``peer`` if it closes or fails first."""
    view, got = memoryview(buffer), 0
    while got < len(buffer):
        try:
            count = sock.recv_into(view[got:])
        except OSError as exc:
            raise LinkError(f"control lane from {peer} failed: {exc}") from exc
        if not count:
            raise LinkError(f"{peer} closed its control lane (the stage exited or crashed)")
        got += count


def _send_all(sock: socket.socket, head: bytes, tail: memoryview) -> None:
    """``head`` then ``tail`` without joining them (a prefill payload is megabytes)."""
    sent = sock.sendmsg([head, tail])
    total = len(head) + tail.nbytes
    if sent < len(head):
        sock.sendall(head[sent:])
        sent = len(head)
    if sent < total:
        sock.sendall(tail[sent - len(head):])


def _payload_shape(payload: mx.array | None) -> tuple[int, int, mx.Dtype | None]:
    """(rows, row width, dtype) of a payload as its header states them."""
    if payload is None:
        return 0, 0, None
    if payload.ndim == 1:
        return payload.shape[0], 1, payload.dtype
    return payload.shape[0], payload.shape[1], payload.dtype


class OutboundLink:
    """Sends messages to the next stage; connects with retries until a deadline."""

    def __init__(self, ring: Ring | None, peer_rank: int, peer_name: str) -> None:
        self._ring = ring
        self._peer_rank = peer_rank
        self.peer_name = peer_name
        self._sock: socket.socket | None = None
        self._message_no = 0
        self._lane_watchdog: RingWatchdog | None = None  # set: payloads travel on the lane
        self._owed_bytes: int | None = None  # an announced message's payload, not sent yet

    def attach_ring(self, ring: Ring) -> None:
        """The ring forms after the handshake, so links learn of it late."""
        self._ring = ring

    def attach_lane_payloads(self, watchdog: RingWatchdog) -> None:
        """Payloads follow their header on this lane (no ring); ``watchdog`` bounds a blocked send."""
        self._ring = None
        self._lane_watchdog = watchdog

    def connect(self, host: str, port: int, deadline_s: float) -> None:
        end = time.monotonic() + deadline_s
        last_error: OSError | None = None
        while time.monotonic() < end:
            try:
                sock = socket.create_connection((host, port), timeout=2.0)
            except OSError as exc:
                last_error = exc
                time.sleep(0.1)
                continue
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
            return
        raise LinkError(
            f"could not reach {self.peer_name} control lane at {host}:{port} within "
            f"{deadline_s:.0f} s ({last_error}); check that the stage started and that "
            f"the port is open between the hosts"
        )

    def handshake(self, body: dict, timeout_s: float) -> dict:
        """Send HELLO and wait for the peer's verdict; raise LinkError if it refuses."""
        data = wire.encode_body(body)
        self._send_frame(wire.FrameKind.HELLO, (), body=data)
        sock = self._require_sock()
        sock.settimeout(timeout_s)
        try:
            header = wire.unpack_header(_recv_exact(sock, wire.HEADER_BYTES, self.peer_name))
            reply = wire.decode_body(_recv_exact(sock, header.body_bytes, self.peer_name))
        except TimeoutError:
            raise LinkError(f"{self.peer_name} did not answer the handshake in {timeout_s:.0f} s") from None
        finally:
            sock.settimeout(None)
        if header.kind != wire.FrameKind.HELLO_REPLY:
            raise wire.WireMismatchError(f"{self.peer_name} answered HELLO with {header.kind.name}")
        if not reply.get("ok"):
            raise LinkError(f"{self.peer_name} refused this stage: {reply.get('error')}")
        return reply

    @property
    def can_announce(self) -> bool:
        """Whether a header can go ahead of its payload (lane payloads; the ring's receive is sized then posted)."""
        return self._lane_watchdog is not None

    def send(
        self,
        kind: wire.FrameKind,
        records: Sequence[wire.SequenceRecord] = (),
        payload: mx.array | None = None,
        batch_id: int = 0,
        body: dict | None = None,
        in_flight: int = 0,
    ) -> None:
        data = wire.encode_body(body) if body is not None else b""
        shape = _payload_shape(payload)
        if payload is not None and payload.size > 0 and self._lane_watchdog is not None:
            raw = wire.payload_bytes(payload)  # the device sync; then only host bytes move
            with self._lane_watchdog.guard(f"send {raw.nbytes} payload bytes to {self.peer_name}"):
                self._send_frame(kind, records, shape, body=data, batch_id=batch_id, in_flight=in_flight, tail=raw)
            return
        self._send_frame(kind, records, shape, body=data, batch_id=batch_id, in_flight=in_flight)
        if payload is not None and payload.size > 0:
            assert self._ring is not None, "a payload needs the ring or the lane"
            self._ring.send(payload, self._peer_rank)

    def announce(
        self,
        kind: wire.FrameKind,
        records: Sequence[wire.SequenceRecord],
        rows: int,
        width: int,
        dtype: mx.Dtype,
        batch_id: int = 0,
        body: dict | None = None,
        in_flight: int = 0,
    ) -> None:
        """Send a message's header now and its ``[rows, width]`` payload later (``send_announced``).

        The peer reads exactly the bytes ``send`` would have sent, only earlier: it can build the
        batch's graph while this stage computes the payload. Nothing else may be sent in between.
        """
        if not self.can_announce:
            raise RuntimeError("only lane payloads can be announced ahead of their bytes")
        data = wire.encode_body(body) if body is not None else b""
        self._send_frame(kind, records, (rows, width, dtype), body=data, batch_id=batch_id, in_flight=in_flight)
        self._owed_bytes = rows * width * dtype.size

    def send_announced(self, payload: mx.array) -> None:
        """The payload of the message ``announce`` sent the header of."""
        owed, self._owed_bytes = self._owed_bytes, None
        if owed is None or self._lane_watchdog is None:
            raise RuntimeError("no announced message is waiting for its payload")
        raw = wire.payload_bytes(payload)  # the device sync
        if raw.nbytes != owed:
            raise wire.WireMismatchError(f"announced {owed} payload bytes to {self.peer_name}, have {raw.nbytes}")
        with self._lane_watchdog.guard(f"send {raw.nbytes} payload bytes to {self.peer_name}"):
            try:
                self._require_sock().sendall(raw)
            except OSError as exc:
                raise LinkError(f"{self.peer_name} control lane broke ({exc}): the stage exited or crashed") from exc

    def _send_frame(
        self,
        kind: wire.FrameKind,
        records: Sequence[wire.SequenceRecord],
        shape: tuple[int, int, mx.Dtype | None] = (0, 0, None),
        *,
        body: bytes = b"",
        batch_id: int = 0,
        in_flight: int = 0,
        tail: memoryview | None = None,
    ) -> None:
        if self._owed_bytes is not None:
            raise RuntimeError(f"the payload announced to {self.peer_name} must be sent before another message")
        rows, width, dtype = shape
        header = wire.FrameHeader(
            kind=kind,
            message_no=self._message_no,
            batch_id=batch_id,
            num_records=len(records),
            num_rows=rows,
            row_width=width,
            dtype=dtype,
            body_bytes=len(body),
            in_flight=in_flight,
        )
        self._message_no += 1
        frame = wire.pack_header(header) + wire.pack_records(records) + body
        try:
            if tail is None:
                self._require_sock().sendall(frame)
            else:
                _send_all(self._require_sock(), frame, tail)
        except OSError as exc:
            raise LinkError(
                f"{self.peer_name} control lane broke ({exc}): the stage exited or crashed"
            ) from exc

    def _require_sock(self) -> socket.socket:
        if self._sock is None:
            raise LinkError(f"link to {self.peer_name} is not connected")
        return self._sock

    def wait_peer_gone(self) -> None:
        """Block until the peer's end of the lane closes (or this end is closed). The peer sends nothing after
        the handshake, so a read returns only then: a watcher thread learns of a dead peer at once."""
        sock = self._sock
        if sock is None:
            return
        try:
            while sock.recv(4096):
                pass
        except OSError:
            pass

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None


class InboundLink:
    """Receives messages from the previous stage; the lane is accepted on our own address."""

    def __init__(self, ring: Ring | None, peer_rank: int, peer_name: str) -> None:
        self._ring = ring
        self._peer_rank = peer_rank
        self.peer_name = peer_name
        self._listener: socket.socket | None = None
        self._sock: socket.socket | None = None
        self._expected_no = 0
        self._lane_payloads = False

    def attach_ring(self, ring: Ring) -> None:
        self._ring = ring

    def attach_lane_payloads(self) -> None:
        """Payloads follow their header on this lane (no ring)."""
        self._ring = None
        self._lane_payloads = True

    def listen(self, host: str, port: int) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
        except OSError as exc:
            listener.close()
            raise LinkError(
                f"cannot bind the control lane on {host}:{port} ({exc}); free the port or "
                f"choose another --ring-base-port"
            ) from exc
        listener.listen(1)
        self._listener = listener

    def accept(self, deadline_s: float, on_hello: Callable[[dict], str | None]) -> dict:
        """Accept the peer, read its HELLO, and reply with ``on_hello``'s verdict.

        ``on_hello`` returns None to accept or a message saying why the peer does
        not fit; a refusal is raised here too, so both sides fail loudly.
        """
        assert self._listener is not None
        self._listener.settimeout(deadline_s)
        try:
            sock, _ = self._listener.accept()
        except TimeoutError:
            raise LinkError(
                f"{self.peer_name} did not connect its control lane within {deadline_s:.0f} s"
            ) from None
        finally:
            self._listener.close()
            self._listener = None
        sock.settimeout(deadline_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        try:
            message = self.recv()
        except TimeoutError:
            raise LinkError(f"{self.peer_name} connected but sent no handshake") from None
        if message.kind != wire.FrameKind.HELLO or message.body is None:
            raise wire.WireMismatchError(f"{self.peer_name} opened with {message.kind.name}, not HELLO")
        problem = on_hello(message.body)
        reply = {"ok": problem is None, "error": problem}
        data = wire.encode_body(reply)
        header = wire.FrameHeader(wire.FrameKind.HELLO_REPLY, 0, 0, 0, 0, 0, None, len(data))
        with contextlib.suppress(OSError):
            sock.sendall(wire.pack_header(header) + data)
        sock.settimeout(None)
        if problem is not None:
            raise LinkError(f"refused {self.peer_name}: {problem}")
        return message.body

    @property
    def lane_payloads(self) -> bool:
        """Payloads follow their header on the lane (so ``recv_payload_into`` can take them)."""
        return self._lane_payloads

    def recv(
        self,
        check: Callable[[wire.FrameHeader], None] | None = None,
        timeout_s: float | None = None,
    ) -> wire.Message:
        """Block (in the kernel, not spinning) for the next message; then take its payload.

        ``check`` may refuse the header before any ring receive is posted.
        ``timeout_s`` bounds the wait for a reply that is owed (a batch in
        flight); waiting for new work has no deadline.
        """
        message = self.recv_head(check, timeout_s)
        if not message.header.has_payload:
            return message
        return wire.Message(header=message.header, records=message.records, body=message.body,
                            payload=self.recv_payload(message.header))

    def recv_head(
        self,
        check: Callable[[wire.FrameHeader], None] | None = None,
        timeout_s: float | None = None,
    ) -> wire.Message:
        """The next message's header, records and body; its payload, if any, is left for
        ``recv_payload_into`` (or for ``recv``, which takes both)."""
        sock = self._require_sock()
        sock.settimeout(timeout_s)
        try:
            header = wire.unpack_header(_recv_exact(sock, wire.HEADER_BYTES, self.peer_name))
        except TimeoutError:
            raise LinkError(
                f"{self.peer_name} sent nothing for {timeout_s:.0f} s while a batch was in "
                f"flight: a stage is frozen or unreachable"
            ) from None
        finally:
            sock.settimeout(None)
        if header.message_no != self._expected_no:
            raise wire.WireMismatchError(
                f"{self.peer_name} sent message #{header.message_no}, expected "
                f"#{self._expected_no}: a message was lost or reordered"
            )
        self._expected_no += 1
        records: tuple[wire.SequenceRecord, ...] = ()
        if header.num_records:
            raw = _recv_exact(sock, header.num_records * wire.RECORD_BYTES, self.peer_name)
            records = wire.unpack_records(raw, header.num_records)
        body = None
        if header.body_bytes:
            body = wire.decode_body(_recv_exact(sock, header.body_bytes, self.peer_name))
        if check is not None:
            check(header)
        return wire.Message(header=header, records=records, body=body)

    def recv_payload(self, header: wire.FrameHeader) -> mx.array:
        """The payload ``header`` announced (``recv_head``), from the lane or the ring."""
        assert header.dtype is not None
        if self._lane_payloads:
            buffer = bytearray(wire.payload_nbytes(header))
            recv_exactly_into(self._require_sock(), buffer, self.peer_name)
            return wire.payload_from_bytes(buffer, header)
        if self._ring is None:
            raise wire.WireMismatchError(f"{self.peer_name} sent a ring payload on a ring-less link")
        return self._ring.recv(header.payload_shape, header.dtype, self._peer_rank)

    def recv_payload_into(self, header: wire.FrameHeader, buffer: memoryview) -> None:
        """The lane payload ``header`` announced, written into ``buffer`` (a placeholder's bytes)."""
        if not self._lane_payloads:
            raise RuntimeError("only lane payloads can be received into a buffer")
        if buffer.nbytes != wire.payload_nbytes(header):
            raise wire.WireMismatchError(
                f"{self.peer_name} announced {wire.payload_nbytes(header)} payload bytes; "
                f"the buffer holds {buffer.nbytes}")
        recv_exactly_into(self._require_sock(), buffer, self.peer_name)

    def _require_sock(self) -> socket.socket:
        if self._sock is None:
            raise LinkError(f"link from {self.peer_name} is not connected")
        return self._sock

    def close(self) -> None:
        for sock in (self._sock, self._listener):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        self._sock = self._listener = None
