"""Mutual TLS for every Crucible connection (no torch, no cryptography here).

One process-wide setting, read by ``crucible.rpc`` for every server it starts
and every channel it dials (coordinator, data plane, probes, weight pulls,
pulse, status): either plaintext or mutual TLS with one CA. With TLS, a server
asks every client for a certificate signed by the CA, and a client checks the
server's certificate against the address it dialled (an IP or DNS name in the
certificate's subjectAltName). The shared token is still required on every
call: TLS says "a host of this job", the token "a member of this job".

Where the files come from (a process reads them before it knows the job's
configuration, so never from the configuration a worker receives):

* ``--tls-dir DIR`` / ``$CRUCIBLE_TLS_DIR``: ``DIR/ca.pem`` and this host's
  ``DIR/<host>.pem`` + ``DIR/<host>.key``, where ``<host>`` is ``--tls-host`` /
  ``$CRUCIBLE_TLS_HOST``, else this machine's name (``crucible certs`` writes
  that layout);
* or the three files: ``--tls-ca/--tls-cert/--tls-key`` /
  ``$CRUCIBLE_TLS_CA``, ``$CRUCIBLE_TLS_CERT``, ``$CRUCIBLE_TLS_KEY``;
* ``crucible launch`` and ``crucible coordinator`` also take ``net.tls_dir``
  or ``net.tls_ca/cert/key`` from the job's configuration.

A process that resolves its files exports the three paths (``export``) so
that its children (a worker's pulse and persister, the launcher's workers)
use the same ones.

When a connection fails, ``diagnose`` says whether TLS is why, in words: this
process speaks plaintext to a TLS server, TLS to a plaintext server, or its
certificate (or the server's) is not of the job's CA.
"""

from __future__ import annotations

import base64
import os
import re
import socket
import ssl
from dataclasses import dataclass

ENV_DIR, ENV_HOST = "CRUCIBLE_TLS_DIR", "CRUCIBLE_TLS_HOST"
ENV_CA, ENV_CERT, ENV_KEY = "CRUCIBLE_TLS_CA", "CRUCIBLE_TLS_CERT", "CRUCIBLE_TLS_KEY"


class TlsError(ValueError):
    """The TLS files cannot be used; the message names the file or flag."""


@dataclass(frozen=True)
class Files:
    ca: str
    cert: str
    key: str

    def read(self) -> tuple[bytes, bytes, bytes]:
        out = []
        for what, path in (("CA certificate", self.ca), ("certificate", self.cert), ("key", self.key)):
            try:
                with open(path, "rb") as f:
                    out.append(f.read())
            except OSError as e:
                raise TlsError(f"TLS {what} {path}: {e.strerror or e}") from None
        return out[0], out[1], out[2]


def resolve(tls_dir: str = "", host: str = "", ca: str = "", cert: str = "", key: str = "") -> Files | None:
    """The files from a directory (+ host name) or given one by one; None = plaintext.
    A leading ``~`` is this host's home (``net.tls_dir=~/certs``: no shell expands it)."""
    tls_dir, ca, cert, key = (os.path.expanduser(p) for p in (tls_dir, ca, cert, key))
    if tls_dir and (ca or cert or key):
        raise TlsError("give a TLS directory or the CA/certificate/key files, not both")
    if ca or cert or key:
        missing = [n for n, v in (("CA", ca), ("certificate", cert), ("key", key)) if not v]
        if missing:
            raise TlsError(f"TLS needs a CA, a certificate and a key: missing {', '.join(missing)}")
        files = Files(os.path.abspath(ca), os.path.abspath(cert), os.path.abspath(key))
    elif tls_dir:
        if not os.path.isdir(tls_dir):
            raise TlsError(f"TLS directory {tls_dir}: no such directory")
        host = host or socket.gethostname()
        files = Files(*(os.path.abspath(os.path.join(tls_dir, n)) for n in ("ca.pem", f"{host}.pem", f"{host}.key")))
        if not os.path.exists(files.cert):
            have = sorted(n[:-4] for n in os.listdir(tls_dir) if n.endswith(".pem") and n not in ("ca.pem",))
            raise TlsError(f"TLS directory {tls_dir} has no certificate for host '{host}' (it has: "
                           f"{', '.join(have) or 'none'}); pass --tls-host NAME or set {ENV_HOST}")
    else:
        return None
    check(files)        # every file readable and usable, now rather than at the first connection
    return files


_PEM = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\r?\n(.*?)-----END \1-----", re.S)


def _pem_blocks(data: bytes, path: str, what: str, noun: str, want) -> list[bytes]:
    """The PEM blocks of `data` whose type `want` accepts (base64 that decodes), else TlsError."""
    found = [(kind.decode(), body) for kind, body in _PEM.findall(data)]
    if not found:
        raise TlsError(f"TLS {what} {path}: not PEM (no -----BEGIN ...----- block)")
    ok = [body for kind, body in found if want(kind)]
    if not ok:
        raise TlsError(f"TLS {what} {path}: not a {noun} (its PEM blocks: {', '.join(k for k, _ in found)})")
    for body in ok:
        lines = [x for x in body.split(b"\n") if x.strip() and b":" not in x]   # (RFC 1421 headers)
        try:
            base64.b64decode(b"".join(x.strip() for x in lines), validate=True)
        except ValueError:
            raise TlsError(f"TLS {what} {path}: its PEM block is not valid base64") from None
    return ok


def check(files: Files) -> None:
    """Each file readable and of its kind, the key that of the certificate:
    TlsError naming the file otherwise (a gRPC server given garbage fails later
    with only 'Failed to bind to address'). PEM structure here, the rest by
    the standard library's OpenSSL (gRPC's BoringSSL reads the same PEM)."""
    ca, cert, key = files.read()
    _pem_blocks(ca, files.ca, "CA certificate", "certificate", lambda k: k == "CERTIFICATE")
    _pem_blocks(cert, files.cert, "certificate", "certificate", lambda k: k == "CERTIFICATE")
    _pem_blocks(key, files.key, "key", "private key", lambda k: k.endswith("PRIVATE KEY"))
    def context() -> ssl.SSLContext:
        # Readability only: OpenSSL's security level (small keys, weak digests) is
        # gRPC's to judge, and it takes what this host's OpenSSL policy may refuse.
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
        return ctx

    for what, path, data in (("CA certificate", files.ca, ca), ("certificate", files.cert, cert)):
        try:
            context().load_verify_locations(cadata=data.decode("latin-1"))
        except ssl.SSLError as e:
            raise TlsError(f"TLS {what} {path}: not a readable X.509 certificate"
                           f"{f' ({e.reason})' if e.reason else ''}") from None

    def no_password():
        raise TlsError(f"TLS key {files.key} is encrypted: give it without a passphrase")

    try:
        context().load_cert_chain(files.cert, files.key, password=no_password)
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e):
            raise TlsError(f"TLS key {files.key} does not match the certificate {files.cert}") from None
        raise TlsError(f"TLS key {files.key}: not a readable private key ({e.reason or e})") from None
    except OSError as e:
        raise TlsError(f"TLS key {files.key}: {e.strerror or e}") from None


def from_env() -> Files | None:
    e = os.environ
    return resolve(e.get(ENV_DIR, ""), e.get(ENV_HOST, ""), e.get(ENV_CA, ""), e.get(ENV_CERT, ""), e.get(ENV_KEY, ""))


def export(files: Files | None) -> None:
    """Hand the files to this process's children (and to from_env)."""
    for k in (ENV_DIR, ENV_HOST, ENV_CA, ENV_CERT, ENV_KEY):
        os.environ.pop(k, None)
    if files is not None:
        os.environ.update({ENV_CA: files.ca, ENV_CERT: files.cert, ENV_KEY: files.key})


def server_credentials(files: Files):
    import grpc

    ca, cert, key = files.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def channel_credentials(files: Files):
    import grpc

    ca, cert, key = files.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


# ---- why a connection failed -------------------------------------------------------

_PLAINTEXT_PEER = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST",
                   "UNEXPECTED_RECORD", "UNKNOWN_PROTOCOL")
_CERT_REFUSED = ("CERTIFICATE_REQUIRED", "BAD_CERTIFICATE", "UNKNOWN_CA", "CERTIFICATE_UNKNOWN",
                 "HANDSHAKE_FAILURE", "ACCESS_DENIED", "DECRYPT_ERROR", "CERTIFICATE_EXPIRED")
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def diagnose(address: str, files: Files | None, timeout: float = 3.0) -> str | None:
    """Why a connection to `address` fails, when TLS is the reason; None when
    TLS is not (or the server cannot be reached at all)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except (OSError, ValueError):
        return None
    try:
        if files is None:
            return _plaintext_client(sock, host, address)
        return _tls_client(sock, host, address, files)
    finally:
        sock.close()


def _plaintext_client(sock: socket.socket, host: str, address: str) -> str | None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    try:
        with ctx.wrap_socket(sock, server_hostname=host or None, do_handshake_on_connect=True):
            pass
    except ssl.SSLError as e:
        if not any(m in (e.reason or "") for m in _CERT_REFUSED):
            return None              # it answered, but not in TLS: not a TLS problem
    except OSError:
        return None
    return (f"the server at {address} speaks TLS and this process does not: give it the job's certificates "
            f"(--tls-dir DIR or ${ENV_DIR}, see `crucible certs`)")


def _tls_client(sock: socket.socket, host: str, address: str, files: Files) -> str | None:
    try:
        ctx = ssl.create_default_context(cafile=files.ca)
        ctx.load_cert_chain(files.cert, files.key)
    except (ssl.SSLError, OSError) as e:
        return f"this process's TLS files cannot be used ({files.cert}): {e}"
    ctx.set_alpn_protocols(["h2"])
    refused = (f"the server at {address} refused this process's certificate (it closed the connection after "
               f"the TLS handshake): {files.cert} is not signed by the job's CA")
    try:
        with ctx.wrap_socket(sock, server_hostname=host) as s:
            # TLS 1.3 servers judge the client's certificate after the handshake:
            # a gRPC server that accepts it answers the HTTP/2 preface with its
            # SETTINGS; one that refuses it closes the connection.
            s.sendall(_H2_PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            s.settimeout(2.0)
            try:
                if s.recv(9) == b"":
                    return refused
            except (socket.timeout, TimeoutError):
                pass
    except ssl.SSLEOFError:
        return refused
    except ssl.SSLCertVerificationError as e:
        return (f"the server at {address} presented a certificate this process does not trust "
                f"({e.verify_message}): is it of the job's CA ({files.ca}), made for '{host}'?")
    except ssl.SSLError as e:
        reason = e.reason or str(e)
        if any(m in reason for m in _PLAINTEXT_PEER):
            return (f"the server at {address} does not speak TLS (plaintext gRPC) and this process does: start "
                    f"it with the job's certificates too, or this process without them")
        if any(m in reason for m in _CERT_REFUSED):
            return (f"the server at {address} refused this process's certificate ({reason.lower()}): "
                    f"{files.cert} is not signed by the job's CA")
        return f"TLS with the server at {address} failed: {reason}"
    except OSError:
        return None
    return None
