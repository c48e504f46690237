"""Test certificates made at run time with the ``openssl`` command (Debian's
``openssl`` package; ``make test`` installs it when missing).

:func:`make_pki` writes, in a directory: a CA, a broker certificate it signed
for ``localhost`` and ``127.0.0.1``, a client certificate it signed (mutual
TLS), a *peer* certificate for the same names that may serve as both server and
client (a broker's certificate on the HA links, where each broker is both), and a
second, unrelated CA (a client that trusts only that one must refuse the broker).
:func:`ha_link_args` adds a secret file: the ``serve`` arguments of an HA link
with a secret and TLS. The commands are those of docs/tls.md; EC P-256 keys,
because they take no time to make.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

#: Days the test certificates are valid.
DAYS = "2"
#: The key of every certificate: EC P-256 (an RSA key takes a noticeable time).
KEY_ARGS = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


@dataclass(frozen=True)
class Pki:
    """The files :func:`make_pki` wrote."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    peer_cert: Path
    peer_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(directory: Path, name: str) -> None:
    _openssl("req", "-x509", *KEY_ARGS, "-keyout", f"{name}.key", "-out", f"{name}.pem",
             "-days", DAYS, "-subj", f"/CN=txbroker test {name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)


def _signed(directory: Path, name: str, subject: str, extensions: str) -> None:
    _openssl("req", *KEY_ARGS, "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", subject, cwd=directory)
    (directory / f"{name}.ext").write_text(extensions)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", DAYS, "-extfile", f"{name}.ext",
             "-out", f"{name}.pem", cwd=directory)


def make_pki(directory: Path) -> Pki:
    """Make the test CA and certificates in ``directory`` (created if missing)."""
    directory.mkdir(parents=True, exist_ok=True)
    _ca(directory, "ca")
    _ca(directory, "other-ca")
    _signed(directory, "broker", "/CN=localhost",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
            "extendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n"
            "keyUsage=critical,digitalSignature\n")
    _signed(directory, "peer", "/CN=localhost",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
            "extendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n"
            "keyUsage=critical,digitalSignature\n")
    _signed(directory, "client", "/CN=txbroker test client",
            "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n"
            "keyUsage=critical,digitalSignature\n")
    return Pki(ca=directory / "ca.pem", server_cert=directory / "broker.pem",
               server_key=directory / "broker.key", client_cert=directory / "client.pem",
               client_key=directory / "client.key", other_ca=directory / "other-ca.pem",
               peer_cert=directory / "peer.pem", peer_key=directory / "peer.key")


def tls_args(pki: Pki, tls_port: int, *extra: str) -> list[str]:
    """``txbroker serve`` arguments for a native TLS listener on ``tls_port``."""
    return ["--tls-port", str(tls_port), "--tls-cert", str(pki.server_cert),
            "--tls-key", str(pki.server_key), *extra]


#: The HA secret of the tests' secured links.
HA_SECRET = "test-ha-secret-0123456789abcdef"


def ha_link_args(directory: Path, *, tls: bool = True, secret: str = HA_SECRET) -> list[str]:
    """``txbroker serve`` arguments for an HA link with a secret (in a file) and, with
    ``tls``, TLS with the peer certificate verified against the test CA (``directory``
    gets the files)."""
    directory.mkdir(parents=True, exist_ok=True)
    secret_file = directory / "ha.secret"
    secret_file.write_text(secret + "\n")
    args = ["--ha-secret-file", str(secret_file)]
    if tls:
        pki = make_pki(directory / "pki")
        args += ["--ha-tls", "--tls-cert", str(pki.peer_cert), "--tls-key",
                 str(pki.peer_key), "--ha-tls-ca", str(pki.ca)]
    return args
