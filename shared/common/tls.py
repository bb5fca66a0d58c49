"""Mutual TLS inside the fleet: gateways and nodes prove they are fleet members to each other.

A fleet has one certificate authority. Every process holds a certificate it signed, good for both ends of a
connection (serverAuth and clientAuth), and the CA's certificate. A node's gRPC server requires a client
certificate signed by that CA (so a caller without one cannot open a channel, let alone reserve blocks), and a
gateway checks the node's certificate against the same CA.

Certificates name the fleet, not a host: every one carries the DNS name `kvrelay.fleet` and channels check the
peer against that name (`grpc.ssl_target_name_override`). Nodes come and go at addresses nobody knows in advance
(pods, `kvrelay up`'s free ports); what makes a peer trustworthy is that the fleet's CA signed it, and the CA is
the fleet's alone.

`kvrelay up` makes the CA and the certificates (`make_fleet_pki`, with the `cryptography` package) in its run
folder, readable by its user only; on Kubernetes they come from a secret (deploy/). A process takes them with
`--tls-ca-file`, `--tls-cert-file` and `--tls-key-file`.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

FLEET_NAME = "kvrelay.fleet"


@dataclass(frozen=True)
class TLSFiles:
    """PEM files: the fleet's CA certificate, this process's certificate and its private key."""

    ca_file: str
    cert_file: str
    key_file: str

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return _read_pem(self.ca_file), _read_pem(self.cert_file), _read_pem(self.key_file)

    def server_credentials(self):
        """A gRPC server's: it presents its certificate and requires one from every client, signed by the CA."""
        import grpc

        ca, cert, key = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self):
        import grpc

        ca, cert, key = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    @staticmethod
    def channel_options() -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", FLEET_NAME), ("grpc.default_authority", FLEET_NAME)]


def tls_from_flags(ca_file: str | None, cert_file: str | None, key_file: str | None) -> TLSFiles | None:
    """None when no flag is given; all three or an error naming what is missing."""
    given = {"--tls-ca-file": ca_file, "--tls-cert-file": cert_file, "--tls-key-file": key_file}
    if not any(given.values()):
        return None
    missing = [flag for flag, value in given.items() if not value]
    if missing:
        raise ValueError(f"tls: give all of --tls-ca-file, --tls-cert-file and --tls-key-file (missing: "
                         f"{', '.join(missing)})")
    files = TLSFiles(ca_file, cert_file, key_file)
    files._read()
    return files


@dataclass(frozen=True)
class ServingTLS:
    """TLS of the gateway's own APIs (HTTP and gRPC), vLLM's `--ssl-certfile`/`--ssl-keyfile`: the certificate
    clients know the gateway by (the operator's, for its public name; not the fleet's). With `ca_certs`, every
    client must also present a certificate that CA signed. API keys still apply: TLS keeps them secret."""

    certfile: str
    keyfile: str
    ca_certs: str | None = None

    def grpc_server_credentials(self):
        import grpc

        files = [self.keyfile, self.certfile] + ([self.ca_certs] if self.ca_certs else [])
        key, cert, *ca = [_read_pem(f) for f in files]
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca[0] if ca else None,
                                           require_client_auth=bool(ca))

    def uvicorn_options(self) -> dict:
        import ssl

        return {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile, "ssl_ca_certs": self.ca_certs,
                "ssl_cert_reqs": ssl.CERT_REQUIRED if self.ca_certs else ssl.CERT_NONE}


def serving_tls_from_flags(certfile: str | None, keyfile: str | None,
                           ca_certs: str | None = None) -> ServingTLS | None:
    """None without --ssl-certfile/--ssl-keyfile; both, readable and a matching pair, or an error saying what."""
    if not certfile and not keyfile:
        if ca_certs:
            raise ValueError("tls: --ssl-ca-certs needs --ssl-certfile and --ssl-keyfile")
        return None
    if not certfile or not keyfile:
        raise ValueError("tls: give both --ssl-certfile and --ssl-keyfile")
    import ssl

    for f in (certfile, keyfile, ca_certs):
        if f:
            _read_pem(f)
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except ssl.SSLError as e:
        raise ValueError(f"tls: {certfile} and {keyfile} are not a certificate and its key ({e.reason})") from None
    return ServingTLS(certfile, keyfile, ca_certs or None)


def _read_pem(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"tls: cannot read {e.filename}: {e.strerror}") from None


def make_fleet_pki(folder: str | os.PathLike[str], names: list[str], days: int = 30) -> dict[str, TLSFiles]:
    """A new CA in `folder` (mode 0700) and, for each name, a certificate it signed: {name: its files}.
    The CA's private key is not kept: nothing can sign another member once the fleet is made."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvrelay fleet CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                            crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    ca_file = root / "ca.pem"
    _write(ca_file, ca_cert.public_bytes(serialization.Encoding.PEM))
    out = {}
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(FLEET_NAME)]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .sign(ca_key, hashes.SHA256()))
        cert_file, key_file = root / f"{name}.pem", root / f"{name}.key"
        _write(cert_file, cert.public_bytes(serialization.Encoding.PEM))
        _write(key_file, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        out[name] = TLSFiles(str(ca_file), str(cert_file), str(key_file))
    return out


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
