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

HOST_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,253}$")


def _write(path: str, data: bytes, private: bool) -> None:
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def make(out: str, hosts: list[str], days: int = 365, force: bool = False) -> list[str]:
    """Make (or extend) the directory; returns the files written."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise SystemExit("crucible certs needs the 'cryptography' package: pip install 'crucible[cluster]'") from None
    for h in hosts:
        if not HOST_RE.match(h) or h in ("ca",):
            raise ValueError(f"--hosts: {h!r} is not a host name or address")
    os.makedirs(out, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)
    written = []

    def pem_key(k) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    ca_cert_path, ca_key_path = os.path.join(out, "ca.pem"), os.path.join(out, "ca.key")
    if os.path.exists(ca_cert_path) and os.path.exists(ca_key_path):
        with open(ca_key_path, "rb") as f:
            ca_key = serialization.load_pem_private_key(f.read(), password=None)
        with open(ca_cert_path, "rb") as f:
            ca_cert = x509.load_pem_x509_certificate(f.read())
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Crucible job CA")])
        ca_cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                   .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                content_commitment=False, key_encipherment=False,
                                                data_encipherment=False, key_agreement=False,
                                                encipher_only=False, decipher_only=False), critical=True)
                   .sign(ca_key, hashes.SHA256()))
        _write(ca_key_path, pem_key(ca_key), private=True)
        _write(ca_cert_path, ca_cert.public_bytes(serialization.Encoding.PEM), private=False)
        written += [ca_cert_path, ca_key_path]
    for h in hosts:
        cert_path, key_path = os.path.join(out, f"{h}.pem"), os.path.join(out, f"{h}.key")
        if os.path.exists(cert_path) and not force:
            continue
        try:
            san = x509.IPAddress(ipaddress.ip_address(h))
        except ValueError:
            san = x509.DNSName(h)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, h)]))
                .issuer_name(ca_cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
                .add_extension(x509.SubjectAlternativeName([san]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write(key_path, pem_key(key), private=True)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)
        written += [cert_path, key_path]
    return written


def main(args) -> int:
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    if not hosts:
        print("crucible certs: --hosts needs at least one host", file=sys.stderr)
        return 2
    try:
        written = make(args.out, hosts, days=args.days, force=args.force)
    except ValueError as e:
        print(f"crucible certs: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    print(f"crucible certs: {len(hosts)} host(s) in {args.out}; start each process with "
          f"--tls-dir {args.out} --tls-host HOST", file=sys.stderr)
    return 0
