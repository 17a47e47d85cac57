"""Object-store servers on 127.0.0.1 for the cloud tests and ``bench/cloud.py``.

* :class:`GcsEmulator`: ``gcp-storage-emulator`` in memory, in this process, with its two
  defects worked around: suffix ranges (``Range: bytes=-N``, which zarr uses for shard indexes)
  are translated to ``bytes=SIZE-N-`` before the emulator sees them, and the listen backlog is
  128 instead of the stdlib's 5 (above 5 concurrent connections, dropped SYNs cost ~1 s each).
* :class:`MotoS3`: moto's threaded S3 server.
* :class:`TcpProxy`: a loopback TCP proxy in front of either, on its own event-loop thread. It
  delays every chunk by a fixed latency (pipelined: data keeps flowing while earlier chunks wait,
  so concurrent transfers overlap as on a real network), optionally caps the bandwidth of each
  connection and of all of them together (a cloud VM's link to a bucket), logs every HTTP
  request it forwards, counts the requests in flight (head sent to response fully delivered),
  and can answer chosen requests with an HTTP error or reset their connection.

Everything binds 127.0.0.1 and picks free ports. Each class is a context manager and stops what
it started. ``bench/cloud.py`` imports this module (it puts ``tests/`` on ``sys.path``).

Set ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` before gcsfs is imported when talking to the
emulator: otherwise gcsfs probes the endpoint over gRPC and every operation takes 60 s.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import http.server
import json
import logging
import re
import socket
import struct
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

__all__ = ["GcsEmulator", "MotoS3", "ProxiedRequest", "TcpProxy", "free_port"]

log = logging.getLogger(__name__)

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------------------------
# GCS: gcp-storage-emulator
# --------------------------------------------------------------------------------------------


class _Httpd(http.server.HTTPServer):
    request_queue_size = 128  # the stdlib's 5 drops SYNs under concurrency: ~1 s stalls

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client (or the fault-injecting proxy) hanging up mid-response is expected here;
        # the stdlib would print a traceback for each one. Anything else is still reported.
        if isinstance(sys.exc_info()[1], (ConnectionError, BrokenPipeError)):
            return
        super().handle_error(request, client_address)

    allow_reuse_address = True


_EMULATOR_MTIME = 1_700_000_000  # what the GCS emulator's Last-Modified says of every object


def _emulator_handler_class() -> type:
    from gcp_storage_emulator import server as gse
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    download_patterns = [
        re.compile(regex)
        for regex, handlers in gse.HANDLERS
        if handlers.get(gse.GET) is objects.download
    ]
    suffix = re.compile(r"\s*bytes=-(\d+)\s*")

    class Handler(gse.RequestHandler):
        _sent = frozenset[str]()
        #: Headers GCS sends with an object's bytes: its generation, and an ETag per version.
        _object_headers: tuple[tuple[str, str], ...] = ()

        def do_GET(self) -> None:
            self._unquote_bucket()
            found = self._object()
            self._object_headers = ()
            if found is not None:
                generation = str(found[1]["generation"])
                etag = f'"{generation}"'
                # GCS's preconditions: ifGenerationMatch (JSON API), If-Match (XML API).
                query = parse_qs(urlparse(self.path).query)
                wanted = query.get("ifGenerationMatch", [generation])[0]
                if_match = self.headers.get("If-Match")
                if wanted != generation or (if_match is not None and if_match != etag):
                    self._precondition_failed()
                    return
                self._object_headers = (("x-goog-generation", generation), ("ETag", etag))
                self._translate_suffix_range(len(found[0]))
            super().do_GET()

        def _precondition_failed(self) -> None:
            body = json.dumps({"error": {"code": 412, "message": "conditionNotMet"}}).encode()
            self.send_response(412)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _unquote_bucket(self) -> None:
            # GCS's XML API (/BUCKET/OBJECT, obstore's) takes a percent-encoded bucket name
            # (obstore sends "asyncflat%2Dtest"); the emulator's route matches it only plain.
            path, mark, query = self.path.partition("?")
            first, slash, rest = path[1:].partition("/")
            if "%" in first and first not in ("storage", "download", "upload", "b", "batch"):
                self.path = f"/{unquote(first)}{slash}{rest}{mark}{query}"

        # GCS sends Last-Modified and ETag with every object download, and some clients
        # (obstore's) refuse a download without them; the emulator sends neither.
        def send_header(self, keyword: str, value: str) -> None:
            self._sent = self._sent | {keyword.lower()}
            super().send_header(keyword, value)

        def end_headers(self) -> None:
            if "last-modified" not in self._sent:
                super().send_header("Last-Modified", self.date_time_string(_EMULATOR_MTIME))
            for name, value in self._object_headers:
                if name.lower() not in self._sent:
                    super().send_header(name, value)
            if "etag" not in self._sent and not self._object_headers:
                super().send_header("ETag", '"asyncflat-emulator"')
            self._sent, self._object_headers = frozenset(), ()
            super().end_headers()

        def _object(self) -> tuple[bytes, dict[str, Any]] | None:
            """The bytes and metadata of the object a download names (None: not one)."""
            path = urlparse(self.path).path
            for pattern in download_patterns:
                found = pattern.fullmatch(path)
                if found is None:
                    continue
                params = {k: unquote(v) for k, v in found.groupdict().items()}
                try:
                    data = self.storage.get_file(params["bucket_name"], params["object_id"])
                    meta = self.storage.get_file_obj(params["bucket_name"], params["object_id"])
                except NotFound:  # let the emulator answer 404 itself
                    return None
                return data, meta
            return None

        def _translate_suffix_range(self, size: int) -> None:
            match = suffix.fullmatch(self.headers.get("Range") or "")
            if match is None:
                return
            start = max(0, size - int(match.group(1)))
            self.headers.replace_header("Range", f"bytes={start}-")

    return Handler


class GcsEmulator:
    """An in-memory GCS emulator on 127.0.0.1 with one bucket; ``endpoint`` is its base URL."""

    def __init__(self, bucket: str = "asyncflat-test", port: int = 0) -> None:
        self.bucket = bucket
        self._port = port
        self._httpd: _Httpd | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        assert self._httpd is not None, "not started"
        return f"http://{HOST}:{self._httpd.server_address[1]}"

    @property
    def port(self) -> int:
        assert self._httpd is not None, "not started"
        return int(self._httpd.server_address[1])

    def start(self) -> GcsEmulator:
        from gcp_storage_emulator.handlers import buckets
        from gcp_storage_emulator.storage import Storage

        storage = Storage(use_memory_fs=True)
        buckets.create_bucket(self.bucket, storage)
        self._httpd = _Httpd(
            (HOST, self._port), functools.partial(_emulator_handler_class(), storage)
        )
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="gcs-emulator",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(5)
        self._httpd = self._thread = None

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        """gcsfs options for this emulator (or for a proxy in front of it at ``endpoint``)."""
        return {"endpoint_url": endpoint or self.endpoint, "token": "anon", "project": "test"}

    def __enter__(self) -> GcsEmulator:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------
# S3: moto
# --------------------------------------------------------------------------------------------

#: Environment for botocore against moto: fake credentials, and no probing of the EC2
#: metadata service (a network address) for real ones.
MOTO_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


class MotoS3:
    """moto's S3 server on 127.0.0.1 with one bucket (names need >= 3 characters)."""

    def __init__(self, bucket: str = "asyncflat-test") -> None:
        self.bucket = bucket
        self._server: Any = None
        self.endpoint = ""

    def start(self) -> MotoS3:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one log line per request
        self._server = ThreadedMotoServer(ip_address=HOST, port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        # moto does not check signatures: a plain PUT creates the bucket.
        request = urllib.request.Request(f"{self.endpoint}/{self.bucket}", method="PUT")
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        """s3fs options for this server (or for a proxy in front of it at ``endpoint``)."""
        return {"endpoint_url": endpoint or self.endpoint, "key": "testing", "secret": "testing"}

    def __enter__(self) -> MotoS3:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------
# The latency- and fault-injecting proxy
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ProxiedRequest:
    """One HTTP request seen by the proxy."""

    method: str
    target: str  # path and query, as sent
    range: str | None  # the Range header, if any
    fault: str | None = None  # what the proxy did instead of forwarding it

    @property
    def path(self) -> str:
        return unquote(urlparse(self.target).path)


#: A fault policy: given a request, return None to forward it, an HTTP status (e.g. "503") to
#: answer it with that error, "reset" to reset its connection, "blackhole" to accept it and
#: never answer (a partitioned or wedged server), or "stall" to forward it and pass on only the
#: response's head and first bytes, then nothing more (a connection that stalls mid-body).
#: Runs on the proxy's thread.
FaultPolicy = Callable[[ProxiedRequest], "str | None"]

_REASONS = {
    403: "Forbidden",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}
_S3_CODES = {
    403: "AccessDenied",
    404: "NoSuchKey",
    429: "SlowDown",
    500: "InternalError",
    503: "SlowDown",
    504: "ServiceUnavailable",
}


def _error_response(status: int, dialect: str) -> bytes:
    reason = _REASONS.get(status, "Error")
    if dialect == "s3":
        code = _S3_CODES.get(status, "InternalError")
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>injected by the test proxy</Message></Error>"
        ).encode()
        content_type = "application/xml"
    else:
        body = json.dumps(
            {
                "error": {
                    "code": status,
                    "message": f"{reason} (injected by the test proxy)",
                    "errors": [{"reason": "injected"}],
                }
            }
        ).encode()
        content_type = "application/json"
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class _DelayedPipe:
    """Writes chunks to ``writer`` ``delay`` seconds after they were handed over, in order;
    reading goes on meanwhile, so transfers pipeline instead of paying the delay per chunk."""

    def __init__(self, writer: asyncio.StreamWriter, delay: float) -> None:
        self._writer = writer
        self._delay = delay
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[float, bytes | None, Callable[[], None] | None]] = (
            asyncio.Queue()
        )
        self._task = asyncio.ensure_future(self._run()) if delay > 0 else None

    async def send(self, data: bytes, then: Callable[[], None] | None = None) -> None:
        """Write ``data`` after the delay; ``then()`` once it is written."""
        if self._task is None:
            self._writer.write(data)
            await self._writer.drain()
            if then is not None:
                then()
        else:
            self._queue.put_nowait((self._loop.time() + self._delay, data, then))

    async def flush(self) -> None:
        """Wait until everything sent so far is written."""
        if self._task is not None:
            self._queue.put_nowait((0.0, None, None))
            await self._task

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            due, data, then = await self._queue.get()
            if data is None:
                return
            wait = due - self._loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self._writer.write(data)
            await self._writer.drain()
            if then is not None:
                then()


class _ResponseBodies:
    """Finds where each response on a connection ends (its head's Content-Length; no body for
    HEAD, 204 and 304), to count requests in flight until their last byte is delivered. A
    response of unknown length (chunked, or until close) counts as done at its first bytes."""

    def __init__(self, pending: collections.deque[str], finished: Callable[[], None]) -> None:
        self._pending, self._finished = pending, finished
        self._head = b""
        self._remaining: int | None = None  # body bytes still to come; None: expecting a head
        self._undelivered = 0  # answered, not yet delivered to the client

    def abandon(self) -> None:
        """The connection is gone: every request still counted is done."""
        for _ in range(len(self._pending) + self._undelivered):
            self._finished()
        self._pending.clear()
        self._undelivered = 0

    def feed(self, data: bytes) -> Callable[[], None] | None:
        """Account for ``data``; returns what to call once it is delivered (requests done)."""
        done = 0
        view = data
        while view:
            if self._remaining is None:
                self._head += view
                end = self._head.find(b"\r\n\r\n")
                if end < 0:
                    break
                head, view = self._head[: end + 4], self._head[end + 4 :]
                self._head = b""
                method = self._pending[0] if self._pending else "GET"
                status = int((head.split(b" ", 2) + [b"0", b"0"])[1] or 0)
                match = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
                    length = 0
                elif match is None:
                    length = 0  # unknown: counted as done now
                else:
                    length = int(match.group(1))
                if 100 <= status < 200:
                    continue  # an interim response: the real one follows
                self._remaining = length
            take = min(len(view), self._remaining)
            view = view[take:]
            self._remaining -= take
            if self._remaining == 0:
                self._remaining = None
                if self._pending:
                    self._pending.popleft()
                    done += 1
        if not done:
            return None
        self._undelivered += done

        def finish() -> None:
            delivered = min(done, self._undelivered)
            self._undelivered -= delivered
            for _ in range(delivered):
                self._finished()

        return finish


class TcpProxy:
    """Forwards 127.0.0.1:``port`` to ``upstream`` (a URL or (host, port)), adding ``latency_s``
    to each request's round trip (half each way) and injecting the faults ``fault`` asks for.

    ``connection_Bps`` and ``total_Bps`` cap the response bandwidth of each connection and of
    all of them together (None: unlimited). ``dialect`` ("gcs" or "s3") shapes the bodies of
    injected HTTP errors so that the client library parses them as its service would send them.
    ``requests`` logs every request; ``in_flight``/``peak_in_flight`` count the requests whose
    response is not fully delivered yet, :meth:`mean_in_flight` their time-weighted mean while
    any is in flight.
    """

    def __init__(
        self,
        upstream: str | tuple[str, int],
        *,
        latency_s: float = 0.0,
        fault: FaultPolicy | None = None,
        dialect: str = "gcs",
        connection_Bps: float | None = None,
        total_Bps: float | None = None,
    ) -> None:
        if isinstance(upstream, str):
            parsed = urlparse(upstream)
            upstream = (parsed.hostname or HOST, int(parsed.port or 80))
        self.upstream = upstream
        self.latency_s = latency_s
        self.fault = fault
        self.dialect = dialect
        self.connection_Bps = connection_Bps
        self.total_Bps = total_Bps
        self.requests: list[ProxiedRequest] = []
        self.bytes_down = 0
        self.connections = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self._busy_s = 0.0  # time with >= 1 request in flight
        self._area = 0.0  # integral of in_flight over time
        self._last = 0.0
        self._link_free = 0.0  # when the shared link has sent everything handed to it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # Every connection's transports, both sides: aborted at stop. ``close()`` of a transport
        # whose peer stopped reading keeps its socket until the buffer drains, i.e. for ever.
        self._transports: set[asyncio.BaseTransport] = set()
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def faults(self) -> list[ProxiedRequest]:
        return [r for r in list(self.requests) if r.fault is not None]

    def mean_in_flight(self) -> float:
        """Time-weighted mean of requests in flight over the time any was in flight."""
        self._tick()
        return self._area / self._busy_s if self._busy_s else 0.0

    def reset_counts(self) -> None:
        """Start the in-flight figures afresh (requests now in flight stay counted)."""
        self._tick()
        self.peak_in_flight = self.in_flight
        self._busy_s = self._area = 0.0

    def _tick(self) -> None:
        now = time.perf_counter()
        if self.in_flight:
            self._busy_s += now - self._last
            self._area += self.in_flight * (now - self._last)
        self._last = now

    def _started(self) -> None:
        self._tick()
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def _finished(self) -> None:
        self._tick()
        self.in_flight -= 1

    async def _pace(self, nbytes: int, connection: list[float]) -> None:
        """Wait until ``nbytes`` more fit the connection's and the link's bandwidth."""
        if self.connection_Bps is None and self.total_Bps is None:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        done = now
        if self.connection_Bps:
            connection[0] = max(now, connection[0]) + nbytes / self.connection_Bps
            done = connection[0]
        if self.total_Bps:
            self._link_free = max(now, self._link_free) + nbytes / self.total_Bps
            done = max(done, self._link_free)
        if done > now:
            await asyncio.sleep(done - now)

    def start(self) -> TcpProxy:
        self._loop = asyncio.new_event_loop()
        started = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.call_soon(started.set)
            self._loop.run_forever()

        self._thread = threading.Thread(target=main, name="tcp-proxy", daemon=True)
        self._thread.start()
        started.wait()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, HOST, 0, backlog=512), self._loop
        ).result(10)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return

        async def shutdown() -> None:
            assert self._server is not None
            self._server.close()
            current = asyncio.current_task()
            while True:
                # A connection accepted just before the close has its handler task created but
                # not started: cancelled now, it would never run its ``finally`` and its socket
                # would be collected unclosed during some later test. Let such tasks start
                # (they register themselves), then cancel everything until nothing is left.
                for _ in range(3):
                    await asyncio.sleep(0)
                tasks = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
                if not tasks:
                    break
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            await self._server.wait_closed()
            for transport in self._transports:
                assert isinstance(transport, asyncio.WriteTransport)
                transport.abort()
            self._transports.clear()
            await asyncio.sleep(0.05)  # let the closed transports release their sockets

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(10)
            loop.close()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- connections --------------------------------------------------------------------------

    def _track(self, writer: asyncio.StreamWriter) -> None:
        def open_(transport: asyncio.BaseTransport) -> bool:
            sock = transport.get_extra_info("socket")
            return sock is not None and sock.fileno() >= 0

        self._transports = {t for t in self._transports if open_(t)}
        self._transports.add(writer.transport)

    async def _serve(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._track(client_writer)
        self.connections += 1
        upstream_writer = None
        try:
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                return
            self._track(upstream_writer)
            to_client = _DelayedPipe(client_writer, self.latency_s / 2)
            to_upstream = _DelayedPipe(upstream_writer, self.latency_s / 2)
            stall = asyncio.Event()  # set: the response now in flight stalls after its head
            pending: collections.deque[str] = collections.deque()  # methods awaiting answers
            up = asyncio.ensure_future(
                self._requests(client_reader, to_upstream, client_writer, stall, pending)
            )
            bodies = _ResponseBodies(pending, self._finished)
            down = asyncio.ensure_future(self._responses(upstream_reader, to_client, stall, bodies))
            try:
                # Whichever side ends first ends the connection: the upstream closing after its
                # response (HTTP/1.0), the client closing, or an injected fault.
                await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pump in (up, down):
                    pump.cancel()
                await asyncio.gather(up, down, return_exceptions=True)
                to_client.cancel()
                to_upstream.cancel()
                bodies.abandon()  # requests never (fully) answered
        except asyncio.CancelledError:
            pass
        finally:
            for writer in (client_writer, upstream_writer):
                if writer is not None and not writer.is_closing():
                    writer.close()
            self._tasks.discard(task)

    async def _responses(
        self,
        reader: asyncio.StreamReader,
        to_client: _DelayedPipe,
        stall: asyncio.Event,
        body: _ResponseBodies,
    ) -> None:
        seen = b""
        connection = [0.0]  # when this connection has sent everything handed to it
        while data := await reader.read(1 << 18):
            if stall.is_set():
                # Pass the head and a few body bytes, then go silent with the connection open.
                seen += data
                head_end = seen.find(b"\r\n\r\n")
                if head_end >= 0 and len(seen) > head_end + 4:
                    await to_client.send(seen[: head_end + 4 + 8])
                    await to_client.flush()
                    await asyncio.Event().wait()  # until the connection is torn down
                continue
            self.bytes_down += len(data)
            await self._pace(len(data), connection)
            await to_client.send(data, body.feed(data))
        if stall.is_set():  # a blackholed request: the upstream was let go, the client waits on
            await asyncio.Event().wait()
        await to_client.flush()

    async def _requests(
        self,
        reader: asyncio.StreamReader,
        to_upstream: _DelayedPipe,
        client_writer: asyncio.StreamWriter,
        stall: asyncio.Event,
        pending: collections.deque[str],
    ) -> None:
        """Forward requests one by one, parsing just enough HTTP to see each one's head."""
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            lines = head.decode("latin-1").split("\r\n")
            method, target = (lines[0].split(" ") + ["", ""])[:2]
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            request = ProxiedRequest(method, target, headers.get("range"))
            self.requests.append(request)
            kind = self.fault(request) if self.fault is not None else None
            if kind == "stall":
                request.fault = kind
                stall.set()
                kind = None
            if kind is not None:
                request.fault = kind
                if kind == "blackhole":
                    # Let the upstream go (the GCS emulator serves one connection at a time:
                    # an idle one would wedge it) while the client waits for ever.
                    stall.set()
                    to_upstream.cancel()
                    to_upstream._writer.close()
                await self._inject(kind, client_writer)
                return
            pending.append(method)
            self._started()
            await to_upstream.send(head)
            if "chunked" in headers.get("transfer-encoding", "").lower():
                # Not parsed further: the rest of this connection is passed through as is.
                while data := await reader.read(1 << 18):
                    await to_upstream.send(data)
                return
            remaining = int(headers.get("content-length", "0") or 0)
            while remaining > 0:
                data = await reader.read(min(remaining, 1 << 18))
                if not data:
                    return
                remaining -= len(data)
                await to_upstream.send(data)

    async def _inject(self, kind: str, client_writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(self.latency_s)
        if kind == "blackhole":
            await asyncio.Event().wait()  # accepted, never answered, until torn down
        if kind == "reset":
            sock = client_writer.get_extra_info("socket")
            if sock is not None:  # SO_LINGER 0: close() sends RST instead of FIN
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client_writer.transport.abort()
            return
        client_writer.write(_error_response(int(kind), self.dialect))
        with contextlib.suppress(ConnectionError):
            await client_writer.drain()
