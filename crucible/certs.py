"""`crucible certs --out DIR --hosts h1,h2,...`: a CA and a certificate per host.

Writes, with the ``cryptography`` package (``pip install 'crucible[cluster]'``):

* ``ca.pem`` (the job's CA certificate) and ``ca.key`` (its key, mode 0600:
  keep it to add hosts later; no process of the job reads it);
* for each host: ``<host>.pem`` (its certificate, signed by the CA, for
  server and client authentication, with the host as its subjectAltName: an
  IP address or a DNS name, the address others dial) and ``<host>.key``
  (mode 0600).

Run it again with more hosts on the same directory: the existing CA signs
them (existing host files are kept unless ``--force``). Keys are ECDSA P-256;
certificates are valid for ``--days`` (default 365). Every process then takes
``--tls-dir DIR --tls-host <its host>`` (or ``$CRUCIBLE_TLS_DIR`` and
``$CRUCIBLE_TLS_HOST``); see README, "TLS".
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import sys
import types

from crucible.files import atomic_write, dir_problem

HOST_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,253}$")


def _crypto():
    """The parts of ``cryptography`` this module uses (the cluster extra)."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise SystemExit("crucible certs needs the 'cryptography' package: pip install 'crucible[cluster]'") from None
    return types.SimpleNamespace(x509=x509, hashes=hashes, serialization=serialization, ec=ec,
                                 ExtendedKeyUsageOID=ExtendedKeyUsageOID, NameOID=NameOID)


def _pem_key(c, key) -> bytes:
    return key.private_bytes(c.serialization.Encoding.PEM, c.serialization.PrivateFormat.PKCS8,
                             c.serialization.NoEncryption())


def _valid(builder, now, days: int):
    return builder.not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))


def _ca(c, out: str, now, days: int, written: list[str]):
    """The directory's CA (key, certificate): the one there, or a new one."""
    cert_path, key_path = os.path.join(out, "ca.pem"), os.path.join(out, "ca.key")
    if os.path.exists(cert_path) and os.path.exists(key_path):
        with open(key_path, "rb") as f:
            key = c.serialization.load_pem_private_key(f.read(), password=None)
        with open(cert_path, "rb") as f:
            return key, c.x509.load_pem_x509_certificate(f.read())
    x509 = c.x509
    key = c.ec.generate_private_key(c.ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(c.NameOID.COMMON_NAME, "Crucible job CA")])
    usage = x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False)
    cert = (_valid(x509.CertificateBuilder().subject_name(name).issuer_name(name), now, days)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(usage, critical=True)
            .sign(key, c.hashes.SHA256()))
    atomic_write(key_path, _pem_key(c, key), mode=0o600)
    atomic_write(cert_path, cert.public_bytes(c.serialization.Encoding.PEM), mode=0o644)
    written += [cert_path, key_path]
    return key, cert


def _host(c, ca_key, ca_cert, host: str, now, days: int):
    """A key and a certificate for ``host`` (its name or address as others
    dial it), for both ends of a connection, signed by the CA."""
    x509, oid = c.x509, c.ExtendedKeyUsageOID
    try:
        san = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        san = x509.DNSName(host)
    key = c.ec.generate_private_key(c.ec.SECP256R1())
    cert = (_valid(x509.CertificateBuilder(), now, days)
            .subject_name(x509.Name([x509.NameAttribute(c.NameOID.COMMON_NAME, host)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([oid.SERVER_AUTH, oid.CLIENT_AUTH]), critical=False)
            .sign(ca_key, c.hashes.SHA256()))
    return key, cert


def make(out: str, hosts: list[str], days: int = 365, force: bool = False) -> list[str]:
    """Make (or extend) the directory; returns the files written."""
    c = _crypto()
    for h in hosts:
        if not HOST_RE.match(h) or h in ("ca",):
            raise ValueError(f"--hosts: {h!r} is not a host name or address")
    os.makedirs(out, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)
    written: list[str] = []
    ca_key, ca_cert = _ca(c, out, now, days, written)
    for h in hosts:
        cert_path, key_path = os.path.join(out, f"{h}.pem"), os.path.join(out, f"{h}.key")
        if os.path.exists(cert_path) and not force:
            continue
        key, cert = _host(c, ca_key, ca_cert, h, now, days)
        atomic_write(key_path, _pem_key(c, key), mode=0o600)
        atomic_write(cert_path, cert.public_bytes(c.serialization.Encoding.PEM), mode=0o644)
        written += [cert_path, key_path]
    return written


def main(args) -> int:
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    if not hosts:
        print("crucible certs: --hosts needs at least one host", file=sys.stderr)
        return 2
    try:      # (before --out is made: a refused command leaves nothing)
        last = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=args.days)
    except OverflowError:
        last = None
    if args.days < 1 or last is None or last.year > 9999:
        # 0 wrote certificates (and a CA, kept by later runs) already expired; past the year 9999
        # an X.509 date cannot say it: an OverflowError traceback
        print(f"crucible certs: --days must be at least 1 and end before the year 10000 (got {args.days})",
              file=sys.stderr)
        return 2
    problem = dir_problem(args.out, make=True)
    if problem:
        print(f"crucible certs: --out {args.out}: {problem}", file=sys.stderr)
        return 2
    try:
        written = make(args.out, hosts, days=args.days, force=args.force)
    except ValueError as e:
        print(f"crucible certs: {e}", file=sys.stderr)
        return 2
    except OSError as e:      # (a disk full; --out changed since the check above)
        print(f"crucible certs: --out {args.out}: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    print(f"crucible certs: {len(hosts)} host(s) in {args.out}; start each process with "
          f"--tls-dir {args.out} --tls-host HOST", file=sys.stderr)
    return 0
