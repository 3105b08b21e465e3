"""Use each optional extra's packages the way Crucible does, at whatever versions are installed.

    python .ci/check_extras.py report cluster

.ci/packaging.sh runs it in the venv where every dependency sits at its
declared minimum, so a lower bound in pyproject.toml's extras is one that
installs, imports and works (together with protobuf/grpcio/numpy at theirs).
Each check does real work (a PNG, event files read back with TensorBoard's
reader, an HTTP scrape, a bitwise round trip, a mutual-TLS gRPC health call,
a schema validation) and raises on any difference. Prints one line per check.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import urllib.request
from importlib import metadata


def _ok(name: str, dist: str, what: str) -> None:
    print(f"extras: {name:<22} {dist} {metadata.version(dist):<10} {what}", flush=True)


# --------------------------------------------------------------------- report


def check_matplotlib(tmp: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(4, 3))
    x = np.arange(50)
    ax.plot(x, np.exp(-x / 20.0), label="loss")
    ax.axvline(20, color="r", linestyle="--")
    ax.legend()
    path = os.path.join(tmp, "loss.png")
    fig.savefig(path, dpi=50)
    plt.close(fig)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", "not a PNG"
    _ok("report: plot", "matplotlib", f"{os.path.getsize(path)} B PNG")


def check_tensorboard(tmp: str) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    logdir = os.path.join(tmp, "tb")
    w = SummaryWriter(log_dir=logdir)
    for step in range(5):
        w.add_scalar("train/loss", 5.0 - step, step)
    w.close()
    acc = EventAccumulator(logdir)
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert got == [(s, 5.0 - s) for s in range(5)], got
    _ok("report: tensorboard", "tensorboard", "SummaryWriter events read back")


def check_prometheus() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

    reg = CollectorRegistry()
    Gauge("crucible_step", "inner step", ["replica"], registry=reg).labels(replica="0").set(7)
    Counter("crucible_faults", "faults handled", registry=reg).inc(2)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=reg)
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    assert 'crucible_step{replica="0"} 7.0' in text, text
    assert "crucible_faults_total 2.0" in text, text
    _ok("report: prometheus", "prometheus-client", "/metrics scraped")


def check_safetensors(tmp: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    tensors = {"wte.weight": torch.randn(16, 8, generator=g),
               "h.0.attn.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
               "tokens": torch.arange(10, dtype=torch.int64)}
    path = os.path.join(tmp, "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    back = load_file(path)
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    _ok("report: export", "safetensors", "bitwise round trip")


# -------------------------------------------------------------------- cluster


def _certs():
    """A CA and one certificate for 127.0.0.1 signed by it, as PEM bytes."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.timezone.utc)

    def pem_key(k):
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "crucible test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    assert cert.not_valid_after_utc > now
    enc = serialization.Encoding.PEM
    return ca.public_bytes(enc), cert.public_bytes(enc), pem_key(key)


def check_tls_health() -> None:
    """Mutual TLS with certificates from `cryptography`, and a grpc.health.v1 Check over it."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    ca, cert, key = _certs()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("crucible.v1.Coordinator", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        ch_creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        with grpc.secure_channel(f"127.0.0.1:{port}", ch_creds) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            reply = stub.Check(health_pb2.HealthCheckRequest(service="crucible.v1.Coordinator"), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, reply
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:  # plaintext to a TLS server must fail
            try:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
            except grpc.RpcError:
                pass
            else:
                raise AssertionError("a plaintext call to the TLS server succeeded")
    finally:
        server.stop(None)
    _ok("cluster: tls certs", "cryptography", "CA + host cert, mutual TLS")
    _ok("cluster: health", "grpcio-health-checking", "Check over mutual TLS: SERVING")


def check_manifests() -> None:
    import kubernetes_validate
    import yaml

    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "crucible-r0s0"},
           "spec": {"backoffLimit": 0, "template": {"spec": {
               "restartPolicy": "Never",
               "containers": [{"name": "worker", "image": "crucible:latest",
                               "command": ["crucible", "worker", "--coordinator", "crucible-coordinator:50051"],
                               "resources": {"limits": {"cpu": "1", "memory": "2Gi"}}}]}}}}
    doc = yaml.safe_load(yaml.safe_dump(job))
    assert doc == job
    kubernetes_validate.validate(doc, "1.30", strict=True)
    bad = {**doc, "spec": {**doc["spec"], "backoffLimit": "zero"}}
    try:
        kubernetes_validate.validate(bad, "1.30", strict=True)
    except kubernetes_validate.ValidationError:
        pass
    else:
        raise AssertionError("an invalid Job manifest validated")
    _ok("cluster: yaml", "pyyaml", "round trip")
    _ok("cluster: k8s schemas", "kubernetes-validate", "Job valid, bad Job refused")


EXTRAS = {
    "report": lambda tmp: (check_matplotlib(tmp), check_tensorboard(tmp), check_prometheus(), check_safetensors(tmp)),
    "cluster": lambda tmp: (check_tls_health(), check_manifests()),
}


def main(argv: list[str]) -> int:
    names = argv or sorted(EXTRAS)
    unknown = [n for n in names if n not in EXTRAS]
    if unknown:
        print(f"check_extras: unknown extra {unknown[0]!r} (known: {', '.join(sorted(EXTRAS))})", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for n in names:
            EXTRAS[n](tmp)
    print(f"extras: {', '.join(names)} ok in {time.monotonic() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
