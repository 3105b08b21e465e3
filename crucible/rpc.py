"""gRPC plumbing shared by the coordinator and the workers (no torch here).

* Every server checks the shared token (``x-crucible-token`` metadata) in an
  interceptor: a call without the right token gets UNAUTHENTICATED before any
  handler runs. The standard health service (``grpc.health.v1.Health``) is
  the one exception: cluster probes carry no token, and it answers only
  SERVING / NOT_SERVING (see ``crucible.health``).
* Handlers are registered with raw-bytes deserializers and parse their request
  themselves, so that a request that is not a valid protobuf gets
  INVALID_ARGUMENT (grpc's own deserializer would answer INTERNAL).
* Handler exceptions are mapped to statuses (``RpcFault`` carries its own code,
  ``ValueError`` is INVALID_ARGUMENT, anything else INTERNAL, logged): a bad
  request never surfaces as UNKNOWN and never takes the process down.
* Message size limits are set on both ends.
* Keepalive on every connection, both ends: a ping after ``keepalive_s`` of
  silence, and a peer that leaves it unanswered for ``keepalive_timeout_s``
  is gone. A silently partitioned peer sends no RST; this is what ends a
  stream to it (``configure`` sets both from the job's configuration:
  ``net.keepalive_s`` and ``fault.heartbeat_timeout_s``).
* TLS (``crucible.tls``): when the process has TLS files, every server is
  mutual TLS and every channel presents this host's certificate.
"""

from __future__ import annotations

from crucible.files import atomic_write

import hmac
import logging
import os
import secrets
from concurrent import futures
from typing import Any, Callable, Iterator

import grpc
from google.protobuf.message import DecodeError

from crucible import tls

log = logging.getLogger("crucible.rpc")

TOKEN_KEY = "x-crucible-token"
TOKEN_ENV = "CRUCIBLE_TOKEN"

_keepalive = {"time_s": 1.0, "timeout_s": 2.0}   # before configure(): the defaults of the configuration
_tls: dict = {}                                  # {"files": tls.Files | None} once resolved


def configure(keepalive_s: float, keepalive_timeout_s: float) -> None:
    """Keepalive of the connections this process makes and serves from now on."""
    _keepalive.update(time_s=float(keepalive_s), timeout_s=float(keepalive_timeout_s))


def use_tls(files: "tls.Files | None") -> None:
    """This process's TLS files (None = plaintext); exported to its children."""
    _tls["files"] = files
    tls.export(files)


def tls_files() -> "tls.Files | None":
    """This process's TLS files: set by use_tls, else from the environment."""
    if "files" not in _tls:
        _tls["files"] = tls.from_env()
    return _tls["files"]


def explain(address: str) -> str | None:
    """Why calls to `address` fail, when TLS is the reason (see tls.diagnose)."""
    return tls.diagnose(address, tls_files())


class BadRequest(ValueError):
    """A streamed request that is not a valid protobuf message."""


class RpcFault(Exception):
    """Raised by a handler to answer with a specific status code."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def new_token() -> str:
    return secrets.token_hex(16)


def read_token(run_dir: str | None = None) -> str:
    """The shared token: $CRUCIBLE_TOKEN, else run_dir/token (written 0600 by launch)."""
    tok = os.environ.get(TOKEN_ENV, "")
    if tok:
        return tok
    if run_dir:
        try:
            with open(os.path.join(run_dir, "token")) as f:
                return f.read().strip()
        except OSError:
            pass
    return ""


def write_token(run_dir: str, token: str) -> str:
    path = os.path.join(run_dir, "token")
    atomic_write(path, token + "\n", mode=0o600)
    return path


def metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_KEY, token),)


def channel_options(max_mb: int) -> list[tuple[str, Any]]:
    n = max_mb << 20
    return [
        ("grpc.max_send_message_length", n),
        ("grpc.max_receive_message_length", n),
        ("grpc.enable_retries", 0),
        # A peer that went away (a restarted coordinator, a replaced worker) is
        # dialled again within a second, not after gRPC's default back-off of
        # up to two minutes.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.keepalive_time_ms", int(_keepalive["time_s"] * 1000)),
        ("grpc.keepalive_timeout_ms", int(_keepalive["timeout_s"] * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def make_channel(address: str, max_mb: int = 64, tls_name: str | None = None) -> grpc.Channel:
    """A channel to ``address``; over TLS, ``tls_name`` is the name its
    certificate must carry where that is not the address's host (a server
    dialled on loopback: its certificate names the host it advertises)."""
    files = tls_files()
    if files is not None:
        options = channel_options(max_mb) + ([("grpc.ssl_target_name_override", tls_name)] if tls_name else [])
        return grpc.secure_channel(address, tls.channel_credentials(files), options=options)
    return grpc.insecure_channel(address, options=channel_options(max_mb))


_HEALTH_PREFIX = "/grpc.health.v1.Health/"


class _TokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str):
        self._token = token.encode()

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None:
            return None
        if details.method.startswith(_HEALTH_PREFIX):
            return handler      # probes carry no token; health tells nothing else (crucible.health)
        supplied = ""
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_KEY:
                supplied = value
        if self._token and hmac.compare_digest(supplied.encode(), self._token):
            return handler
        log.warning("refused %s: missing or wrong token", details.method)

        def deny(request_or_iterator, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong x-crucible-token")

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


MAX_DETAILS = 1000     # characters of a status message (percent-encoded: gRPC refuses a header over 16 KiB)


def details(message: str) -> str:
    """A status message short enough to travel. One that echoes a request's
    field back (a shape of 100,000 dimensions) went over gRPC's header limit:
    the caller got RESOURCE_EXHAUSTED "Stream removed", not the status."""
    if len(message) <= MAX_DETAILS:
        return message
    head, tail = MAX_DETAILS * 4 // 5, MAX_DETAILS // 5       # (the reason may come after the quote)
    return f"{message[:head]} [... {len(message) - head - tail} characters ...] {message[-tail:]}"


def _parse(cls, raw: bytes, context, method: str):
    try:
        msg = cls.FromString(raw)
    except (DecodeError, RuntimeWarning, ValueError, TypeError) as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      details(f"{method}: request is not a valid {cls.__name__}: {e}"))
    return msg


def _fail(context, method: str, exc: BaseException):
    if isinstance(exc, RpcFault):
        context.abort(exc.code, details(exc.message))
    if isinstance(exc, ValueError):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, details(f"{method}: {exc}"))
    log.exception("%s failed", method)
    context.abort(grpc.StatusCode.INTERNAL, details(f"{method}: internal error: {type(exc).__name__}: {exc}"))


def _is_abort(exc: BaseException) -> bool:
    # context.abort() raises a bare Exception after recording the status.
    return type(exc) is Exception


def unary(method: str, request_cls, reply_cls, fn: Callable):
    def handle(raw, context):
        req = _parse(request_cls, raw, context, method)
        try:
            return fn(req, context)
        except Exception as e:  # noqa: BLE001 - mapped to a status
            if _is_abort(e):
                raise
            _fail(context, method, e)

    return grpc.unary_unary_rpc_method_handler(handle, request_deserializer=None,
                                               response_serializer=reply_cls.SerializeToString)


def unary_stream(method: str, request_cls, reply_cls, fn: Callable):
    def handle(raw, context):
        req = _parse(request_cls, raw, context, method)
        try:
            yield from fn(req, context)
        except Exception as e:  # noqa: BLE001
            if _is_abort(e):
                raise
            _fail(context, method, e)

    return grpc.unary_stream_rpc_method_handler(handle, request_deserializer=None,
                                                response_serializer=reply_cls.SerializeToString)


def stream_stream(method: str, request_cls, reply_cls, fn: Callable, serializer: Callable | None = None,
                  parse: Callable | None = None):
    """`serializer` turns what `fn` yields into bytes (default: the reply's
    own serialization); `parse` turns each request's bytes into what `fn`
    iterates over (default: the request's own parser; it raises protobuf's
    DecodeError for bytes that are not a request)."""
    parse = parse or request_cls.FromString
    def handle(raw_iter, context):
        # Requests may be consumed on another thread (a stream reader), where
        # context.abort() cannot be called: a bad message raises BadRequest and
        # the handler turns it into INVALID_ARGUMENT on its own thread.
        def parsed() -> Iterator:
            for raw in raw_iter:
                try:
                    yield parse(raw)
                except (DecodeError, RuntimeWarning, ValueError, TypeError) as e:
                    raise BadRequest(f"{method}: message is not a valid {request_cls.__name__}: {e}") from None

        try:
            yield from fn(parsed(), context)
        except Exception as e:  # noqa: BLE001
            if _is_abort(e):
                raise
            _fail(context, method, e)

    return grpc.stream_stream_rpc_method_handler(handle, request_deserializer=None,
                                                 response_serializer=serializer or reply_cls.SerializeToString)


class BindError(OSError):
    """A server's address that cannot be bound (a port in use, an address of
    another machine), with the OS's reason: one line naming it, not grpc's
    "Failed to bind" and a traceback."""

    def __init__(self, bind: str):
        from crucible.config import bind_problem

        try:
            host, port = split_hostport(bind)
            why = bind_problem(host, port) or "gRPC could not bind it"
        except ValueError as e:
            why = str(e)
        super().__init__(f"{bind}: {why}")
        self.bind = bind


def make_server(service: str, handlers: dict, token: str, bind: str, max_workers: int,
                max_mb: int = 64, health=None) -> tuple[grpc.Server, int]:
    """Start a server for `service` (full name, e.g. crucible.v1.Stage) on `bind`
    (host:port; port 0 picks a free one), with `health` (a crucible.health.Health)
    as its grpc.health.v1 service. Returns (server, port)."""
    if not token:
        raise ValueError("no token: set CRUCIBLE_TOKEN")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=service.rpartition(".")[2]),
        interceptors=[_TokenInterceptor(token)],
        # Clients ping every keepalive_s to find dead connections: allow it
        # instead of answering with GOAWAY "too_many_pings".
        options=channel_options(max_mb) + [("grpc.so_reuseport", 0),
                                           ("grpc.http2.min_recv_ping_interval_without_data_ms", 200),
                                           ("grpc.http2.max_ping_strikes", 0)],
        maximum_concurrent_rpcs=max_workers * 4,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    if health is not None:
        from grpc_health.v1 import health_pb2_grpc

        health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    files = tls_files()
    try:
        if files is not None:
            port = server.add_secure_port(bind, tls.server_credentials(files))
        else:
            port = server.add_insecure_port(bind)
    except RuntimeError:          # (grpc's "Failed to bind ...; set GRPC_VERBOSITY=debug": the OS's reason is ours)
        port = 0
    if port == 0:
        raise BindError(bind)
    server.start()
    return server, port


def split_hostport(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {addr!r} must be host:port")
    return host.strip("[]"), int(port)
