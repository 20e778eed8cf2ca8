"""Throwaway X.509 material for TLS tests, made with the ``openssl`` command.

The ``openssl`` binary is used rather than the ``cryptography`` package so the tests add no
Python dependency (the daemon's own dependencies do not include it). Keys are P-256: fast to
make, and accepted by both etcd (Go) and grpc (BoringSSL).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


class CertError(Exception):
    """openssl is missing or failed."""


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class CertAuthority:
    """A self-signed CA in ``directory`` that signs server and client certificates."""

    name: str
    directory: Path
    cert: Path
    key: Path

    @classmethod
    def create(cls, directory: Path, name: str = "test-ca") -> CertAuthority:
        directory.mkdir(parents=True, exist_ok=True)
        cert, key = directory / f"{name}.crt", directory / f"{name}.key"
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-nodes", "-days", "2", "-subj", f"/CN={name}", "-keyout", str(key),
                 "-out", str(cert), "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        return cls(name=name, directory=directory, cert=cert, key=key)

    def server(self, name: str = "etcd-server", ip: str = "127.0.0.1") -> CertPair:
        """A server certificate for ``ip`` (as an IP SAN: Go ignores the CN for hostnames)."""
        return self._issue(name, f"subjectAltName=IP:{ip},DNS:localhost\n"
                                 "extendedKeyUsage=serverAuth,clientAuth\n")

    def client(self, common_name: str) -> CertPair:
        """A client certificate whose CN is ``common_name`` (etcd may read it as a user name)."""
        return self._issue(common_name, "extendedKeyUsage=clientAuth\n")

    def _issue(self, name: str, extensions: str) -> CertPair:
        stem = self.directory / f"{self.name}-{name}"
        key, csr, cert, ext = (stem.with_suffix(s) for s in (".key", ".csr", ".crt", ".ext"))
        ext.write_text("basicConstraints=CA:FALSE\n"
                       "keyUsage=critical,digitalSignature,keyEncipherment\n" + extensions)
        _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-nodes", "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(csr))
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(self.cert), "-CAkey", str(self.key),
                 "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(cert))
        return CertPair(cert=cert, key=key)


def have_openssl() -> bool:
    return shutil.which("openssl") is not None


def _openssl(*args: str) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        raise CertError("the openssl command is not installed")
    res = subprocess.run([binary, *args], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise CertError(f"openssl {args[0]} failed: {res.stderr.strip()[-500:]}")
