"""The standard gRPC health service (``grpc.health.v1.Health``) on every server.

Cluster probes (Kubernetes' gRPC probes, ``grpc_health_probe``, load
balancers) ask ``Check`` or ``Watch`` for the overall status (service ``""``)
or for one service by name. What each process says:

    coordinator   SERVING from the moment its server is up until it stops
                  (the job is over or it was told to stop): NOT_SERVING then.
    worker        NOT_SERVING until it has registered, built its stage and
                  loaded its state (a replacement: until it has pulled its
                  weights and said ready); SERVING while it trains; NOT_SERVING
                  once it stops (the job is done, it was told to stop, it was
                  evicted).

``""`` and the process's own service (``crucible.v1.Coordinator`` or
``crucible.v1.Stage``) always say the same.

Probes carry no credentials (a kubelet cannot add the job's token to a gRPC
probe), so ``crucible.rpc``'s token interceptor lets the Health service, and
only it, through without ``x-crucible-token``: it answers one enum, reveals
nothing of the job and changes nothing. Every other method still needs the
token.

No torch here; ``grpcio-health-checking`` is a dependency of the project
(its version is pinned to grpcio's).
"""

from __future__ import annotations

from grpc_health.v1 import health as _health
from grpc_health.v1 import health_pb2

SERVICE = "grpc.health.v1.Health"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    """The health servicer of one process, for ``rpc.make_server(health=...)``."""

    def __init__(self, service: str, serving: bool = False):
        self.service = service
        self.servicer = _health.HealthServicer()
        self.serving = None
        self.set(serving)

    def set(self, serving: bool) -> None:
        if serving == self.serving:
            return
        self.serving = serving
        status = SERVING if serving else NOT_SERVING
        for name in ("", self.service):
            self.servicer.set(name, status)

    def stop(self) -> None:
        """NOT_SERVING for good (later ``set`` calls are ignored)."""
        self.set(False)
        self.servicer.enter_graceful_shutdown()


def ask(channel, timeout: float, **kwargs) -> str:
    """Ask a server's overall Health.Check on `channel` (a probe's question:
    it needs no token), with `kwargs` for the call (metadata,
    wait_for_ready): the status's name, e.g. ``SERVING``. Raises
    grpc.RpcError as the call does."""
    from grpc_health.v1 import health_pb2_grpc

    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout, **kwargs)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
