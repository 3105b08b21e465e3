"""Mutual TLS (``crucible certs``, ``--tls-dir``) and who may open a stage boundary.

A 1 x 3 job on loopback runs with TLS on; then: the token is still required;
a worker or status without TLS, or with a certificate of another CA, gets a
clear error; a TLS client talking to a plaintext server too. And a member of
the job (a valid certificate and the token) that opens a stream claiming
another worker's slot, at the current epoch, is refused with
PERMISSION_DENIED: HELLOs are signed by the registration that holds the slot.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import time

import grpc
import pytest

from conftest import ROOT, TINY, crucible_cmd, child_env

from crucible import identity, rpc, tls
from crucible._pb import crucible_pb2 as pb
from crucible._pb import crucible_pb2_grpc as pbg

pytest.importorskip("cryptography")


@contextlib.contextmanager
def using_tls(files):
    """This test process as a TLS client (restored after: other tests run plaintext)."""
    rpc.use_tls(files)
    try:
        yield
    finally:
        rpc.use_tls(None)


def run(args, env=None, timeout=240):
    return subprocess.run(crucible_cmd(*args), cwd=ROOT, env=env or child_env(), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, start_new_session=True)


def test_certs_makes_a_ca_and_host_certificates(tmp_path):
    from cryptography import x509

    out = tmp_path / "tls"
    p = run(["certs", "--out", str(out), "--hosts", "127.0.0.1,node-a.example"])
    assert p.returncode == 0, p.stderr
    for name in ("ca.pem", "ca.key", "127.0.0.1.pem", "127.0.0.1.key", "node-a.example.pem", "node-a.example.key"):
        assert (out / name).exists(), name
    for key in ("ca.key", "127.0.0.1.key", "node-a.example.key"):
        assert stat.S_IMODE(os.stat(out / key).st_mode) == 0o600, key
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    host = x509.load_pem_x509_certificate((out / "node-a.example.pem").read_bytes())
    assert host.issuer == ca.subject
    san = host.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["node-a.example"]
    ip = x509.load_pem_x509_certificate((out / "127.0.0.1.pem").read_bytes())
    assert [str(a) for a in ip.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            .get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    # More hosts later: the same CA signs them.
    assert run(["certs", "--out", str(out), "--hosts", "node-b"]).returncode == 0
    assert x509.load_pem_x509_certificate((out / "node-b.pem").read_bytes()).issuer == ca.subject
    assert x509.load_pem_x509_certificate((out / "ca.pem").read_bytes()) == ca
    bad = run(["certs", "--out", str(out), "--hosts", "no spaces"])
    assert bad.returncode == 2 and "not a host name" in bad.stderr
    with pytest.raises(tls.TlsError, match="no certificate for host 'elsewhere'"):
        tls.resolve(str(out), "elsewhere")


@pytest.fixture(scope="module")
def tls_job(tmp_path_factory):
    from crucible.certs import make
    from conftest import Job

    base = tmp_path_factory.mktemp("tls")
    make(str(base / "ca"), ["127.0.0.1"])
    make(str(base / "other"), ["127.0.0.1"])        # a CA the job does not know
    files = tls.resolve(str(base / "ca"), "127.0.0.1")
    j = Job(base / "run", ["--replicas", "1", "--stages", "3", "--steps", "100000", "--respawn-delay", "-1",
                           "--tls-host", "127.0.0.1"],
            TINY + ["model.n_layer=3", f"net.tls_dir={base / 'ca'}"])
    j.files, j.base = files, base
    try:
        with using_tls(files):
            j.wait_for(lambda st: st["replicas"][0]["step"] >= 3, 300, "training over TLS")
        yield j
    finally:
        j.kill()


def status(job):
    with using_tls(job.files):
        return job.status()


@pytest.mark.slow   # (a variant; the second step of .ci/run)
def test_tls_job_trains_and_the_token_is_still_required(tls_job):
    st = status(tls_job)
    assert st["replicas"][0]["route"] == [0, 1, 2]
    with using_tls(tls_job.files):
        with rpc.make_channel(tls_job.address()) as ch:
            with pytest.raises(grpc.RpcError) as e:
                pbg.CoordinatorStub(ch).Status(pb.StatusRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with rpc.make_channel(tls_job.address()) as ch:       # plaintext gRPC to a TLS server
        with pytest.raises(grpc.RpcError) as e:
            pbg.CoordinatorStub(ch).Status(pb.StatusRequest(), metadata=rpc.metadata(tls_job.token()), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    before = st["replicas"][0]["step"]
    with using_tls(tls_job.files):
        tls_job.wait_for(lambda s: s["replicas"][0]["step"] > before + 5, 60, "more steps")


@pytest.mark.slow   # (a variant; the second step of .ci/run)
def test_plaintext_worker_and_status_get_a_clear_error(tls_job):
    env = dict(child_env(), CRUCIBLE_TOKEN=tls_job.token())
    p = run(["worker", "--coordinator", tls_job.address()], env=env)
    assert p.returncode == 1
    assert f"the server at {tls_job.address()} speaks TLS and this process does not" in p.stderr, p.stderr[-2000:]
    p = run(["status", "--run-dir", tls_job.run_dir])
    assert p.returncode == 1 and "speaks TLS and this process does not" in p.stderr, p.stderr


@pytest.mark.slow   # (a variant; the second step of .ci/run)
def test_a_certificate_of_another_ca_is_refused(tls_job):
    other = tls_job.base / "other"
    env = dict(child_env(), CRUCIBLE_TOKEN=tls_job.token())
    # It trusts the job's CA, but its own certificate is not the job's: the server refuses it.
    p = run(["worker", "--coordinator", tls_job.address(), "--tls-ca", tls_job.files.ca,
             "--tls-cert", str(other / "127.0.0.1.pem"), "--tls-key", str(other / "127.0.0.1.key")], env=env)
    assert p.returncode == 1
    assert f"the server at {tls_job.address()} refused this process's certificate" in p.stderr, p.stderr[-2000:]
    # And one that trusts another CA does not trust the server.
    p = run(["status", "--run-dir", tls_job.run_dir, "--tls-dir", str(other), "--tls-host", "127.0.0.1"])
    assert p.returncode == 1 and "presented a certificate this process does not trust" in p.stderr, p.stderr


@pytest.mark.slow   # (a variant; the second step of .ci/run)
def test_tls_client_to_a_plaintext_server(tls_job, tmp_path):
    coord = subprocess.Popen(crucible_cmd("coordinator", "--run-dir", str(tmp_path / "plain"), "--bind", "127.0.0.1:0",
                                          "--replicas", "1", "--stages", "2", *TINY),
                             cwd=ROOT, env=dict(child_env(), CRUCIBLE_TOKEN="plain-token"), stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        addr_file = tmp_path / "plain" / "coordinator.addr"
        t_end = time.monotonic() + 60
        while not (addr_file.exists() and addr_file.read_text().strip()) and time.monotonic() < t_end:
            time.sleep(0.1)
        p = run(["status", "--coordinator", addr_file.read_text().strip(), "--tls-dir", str(tls_job.base / "ca"),
                 "--tls-host", "127.0.0.1"], env=dict(child_env(), CRUCIBLE_TOKEN="plain-token"))
        assert p.returncode == 1 and "does not speak TLS (plaintext gRPC) and this process does" in p.stderr, p.stderr
    finally:
        os.killpg(coord.pid, 9)
        coord.wait(timeout=10)


def _pipe(job, address: str, hello: pb.Frame) -> grpc.RpcError:
    with using_tls(job.files):
        with rpc.make_channel(address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(pbg.StageStub(ch).Pipe(iter([hello]), metadata=rpc.metadata(job.token()), timeout=10))
    return e.value


@pytest.mark.slow   # (a variant; the second step of .ci/run)
def test_a_stream_claiming_another_workers_slot_is_refused(tls_job):
    st = status(tls_job)
    epoch = st["replicas"][0]["epoch"]
    s2 = next(w for w in st["workers"] if w["stage"] == 2)
    # A member of the job (the job's certificate and token) claims to be stage 1,
    # s2's predecessor, at the current epoch: without r0s1's signature, refused.
    for auth in (b"", os.urandom(32), identity.hello_tag(identity.new_secret(), epoch, 0, 1, 2)):
        hello = pb.Frame(kind=pb.Frame.HELLO, src_replica=0, src_stage=1, epoch=epoch, auth=auth)
        err = _pipe(tls_job, s2["address"], hello)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err.details()
        assert "not signed by the worker registered in that slot" in err.details()
    # The route push that carries s2's expected tag needs s2's own secret.
    with using_tls(tls_job.files):
        with rpc.make_channel(tls_job.address()) as ch:
            with pytest.raises(grpc.RpcError) as e:
                next(iter(pbg.CoordinatorStub(ch).WatchRoutes(pb.WatchRequest(worker_id=s2["worker_id"]),
                                                             metadata=rpc.metadata(tls_job.token()), timeout=10)))
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # The job never noticed.
    before = status(tls_job)
    with using_tls(tls_job.files):
        tls_job.wait_for(lambda s: s["replicas"][0]["step"] > before["replicas"][0]["step"] + 3, 60, "more steps")
    assert not tls_job.events("fault"), tls_job.events("fault")
    assert all(w["state"] == "alive" for w in status(tls_job)["workers"])


def test_garbage_tls_files_stop_launch_before_it_starts_anything(tmp_path):
    """Files that are not PEM: one line naming the file, before a process is
    started or the run directory written (was: 'coordinator exited with 1:
    RuntimeError: Failed to bind to address 127.0.0.1:0')."""
    d = tmp_path / "tls"
    d.mkdir()
    for name in ("ca.pem", "h.pem", "h.key"):
        (d / name).write_text("garbage\n")
    run_dir = tmp_path / "run"
    p = run(["launch", "--tls-dir", str(d), "--tls-host", "h", "--run-dir", str(run_dir), "--no-check",
             "--replicas", "1", "--stages", "2", "--steps", "5", *TINY], timeout=60)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.strip().splitlines() == [f"crucible: TLS CA certificate {d / 'ca.pem'}: not PEM (no "
                                             f"-----BEGIN ...----- block)"], p.stderr
    assert not run_dir.exists()


def test_unusable_tls_files_are_named(tmp_path):
    from crucible.certs import make

    make(str(tmp_path / "a"), ["h"])
    make(str(tmp_path / "b"), ["h"])
    ca, cert, key = (str(tmp_path / "a" / n) for n in ("ca.pem", "h.pem", "h.key"))
    assert tls.resolve(ca=ca, cert=cert, key=key) is not None
    not_x509 = tmp_path / "not-x509.pem"
    not_x509.write_text("-----BEGIN CERTIFICATE-----\nZ2FyYmFnZQ==\n-----END CERTIFICATE-----\n")
    not_b64 = tmp_path / "not-b64.pem"
    not_b64.write_text("-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n")
    not_key = tmp_path / "not-key.key"
    not_key.write_text("-----BEGIN PRIVATE KEY-----\nZ2FyYmFnZQ==\n-----END PRIVATE KEY-----\n")
    other_key = str(tmp_path / "b" / "h.key")
    for files, want in [
        ((ca, key, key), f"TLS certificate {key}: not a certificate (its PEM blocks: PRIVATE KEY)"),
        ((ca, cert, cert), f"TLS key {cert}: not a private key (its PEM blocks: CERTIFICATE)"),
        ((str(not_b64), cert, key), f"TLS CA certificate {not_b64}: its PEM block is not valid base64"),
        ((ca, str(not_x509), key), f"TLS certificate {not_x509}: not a readable X.509 certificate"),
        ((ca, cert, str(not_key)), f"TLS key {not_key}: not a readable private key"),
        ((ca, cert, other_key), f"TLS key {other_key} does not match the certificate {cert}"),
    ]:
        with pytest.raises(tls.TlsError) as e:
            tls.resolve(ca=files[0], cert=files[1], key=files[2])
        assert str(e.value).startswith(want), (want, str(e.value))


@pytest.mark.parametrize("days", [0, -1, 99999999999])
def test_certs_refuses_days_it_cannot_use_and_makes_nothing(tmp_path, capsys, days):
    # 0 wrote an expired CA (which later runs keep); 99999999999 was an OverflowError traceback
    from types import SimpleNamespace

    from crucible import certs

    out = tmp_path / "tls"
    assert certs.main(SimpleNamespace(out=str(out), hosts="a", days=days, force=False)) == 2
    assert capsys.readouterr().err == (f"crucible certs: --days must be at least 1 and end before the year "
                                       f"10000 (got {days})\n")
    assert not out.exists()
