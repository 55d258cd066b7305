"""Real etcd processes for tests: one member or three on loopback, on free ports.

``EtcdCluster(size, tmp_path)``: ``.start_all()``, ``.endpoints`` ("127.0.0.1:PORT" each),
``.stop(i)`` (SIGTERM, waited), ``.kill(i)`` (SIGKILL), ``.start(i)`` (the same member again,
same data directory and ports), ``.wait_healthy()``, ``.close()``.  ``tls=True``: clients must
speak TLS with a client certificate (etcd --client-cert-auth); ``.client_tls`` holds the
files a client needs (ca_file, cert_file, key_file), made with openssl under the data root.  etcd 3.4 from Debian's
etcd-server (/usr/bin/etcd; ``ETCD_BIN`` overrides).  A test that needs etcd is skipped when it
is not installed, unless GOSSIPD_REQUIRE_ETCD=1 (CI), where that fails instead.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

ETCD_BIN = os.environ.get("ETCD_BIN", "/usr/bin/etcd")
START_TIMEOUT_S = 15.0


def etcd_binary() -> str:
    """The etcd binary, or skip (fail under GOSSIPD_REQUIRE_ETCD=1) when it is missing."""
    found = ETCD_BIN if os.path.exists(ETCD_BIN) else shutil.which("etcd")
    if found is None:
        message = "etcd is not installed (apt-get install etcd-server)"
        if os.environ.get("GOSSIPD_REQUIRE_ETCD") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return found


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class EtcdCluster:
    def __init__(
        self,
        size: int,
        tmp_path: Path,
        *,
        heartbeat_ms: int = 100,
        election_ms: int = 1000,
        tls: bool = False,
    ) -> None:
        if size not in (1, 3):
            raise ValueError(f"size: 1 or 3, found {size}")
        self.size = size
        self.binary = etcd_binary()
        self.root = tmp_path / "etcd"
        ports = _free_ports(2 * size)
        self.client_ports = ports[:size]
        self.peer_ports = ports[size:]
        self.names = [f"e{i}" for i in range(size)]
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * size
        self.client_tls: dict[str, str] = _make_certificates(self.root / "tls") if tls else {}
        self._scheme = "https" if tls else "http"
        self._started_once = [False] * size

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.client_ports]

    def _command(self, i: int) -> list[str]:
        cluster = ",".join(
            f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer_ports, strict=True)
        )
        client = f"{self._scheme}://127.0.0.1:{self.client_ports[i]}"
        peer = f"http://127.0.0.1:{self.peer_ports[i]}"
        tls = []
        if self.client_tls:
            d = self.root / "tls"
            tls = [
                f"--cert-file={d / 'server.crt'}",
                f"--key-file={d / 'server.key'}",
                f"--trusted-ca-file={d / 'ca.crt'}",
                "--client-cert-auth",
            ]
        return [
            self.binary,
            *tls,
            "--name",
            self.names[i],
            "--data-dir",
            str(self.root / self.names[i]),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            cluster,
            "--initial-cluster-token",
            f"gossipd-test-{self.client_ports[0]}",
            "--initial-cluster-state",
            "existing" if self._started_once[i] else "new",
            "--heartbeat-interval",
            str(self.heartbeat_ms),
            "--election-timeout",
            str(self.election_ms),
            "--log-level",
            "error",
        ]

    def start(self, i: int) -> None:
        """Start member ``i`` (again: same data directory and ports)."""
        if self.procs[i] is not None and self.procs[i].poll() is None:  # type: ignore[union-attr]
            return
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / f"{self.names[i]}.log", "ab")  # noqa: SIM115
        self.procs[i] = subprocess.Popen(
            self._command(i), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()
        self._started_once[i] = True

    def start_all(self) -> EtcdCluster:
        for i in range(self.size):
            self.start(i)
        self.wait_healthy()
        return self

    def stop(self, i: int, timeout_s: float = 10.0) -> None:
        """SIGTERM member ``i`` and wait for it to exit."""
        self._signal(i, signal.SIGTERM, timeout_s)

    def kill(self, i: int) -> None:
        """SIGKILL member ``i``."""
        self._signal(i, signal.SIGKILL, 10.0)

    def _signal(self, i: int, sig: int, timeout_s: float) -> None:
        proc = self.procs[i]
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def running(self, i: int) -> bool:
        proc = self.procs[i]
        return proc is not None and proc.poll() is None

    def healthy(self, i: int) -> bool:
        """Member ``i`` answers a linearizable read (it has a leader and a quorum)."""
        if not self.running(i):
            return False
        import ssl
        import urllib.request

        context = None
        if self.client_tls:
            context = ssl.create_default_context(cafile=self.client_tls["ca_file"])
            context.load_cert_chain(self.client_tls["cert_file"], self.client_tls["key_file"])
        try:
            with urllib.request.urlopen(
                f"{self._scheme}://127.0.0.1:{self.client_ports[i]}/health",
                timeout=1.0,
                context=context,
            ) as answer:
                return b'"health":"true"' in answer.read()
        except OSError:
            return False

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Every running member healthy, or AssertionError naming the ones that are not."""
        deadline = time.monotonic() + timeout_s
        while True:
            sick = [i for i in range(self.size) if self.running(i) and not self.healthy(i)]
            if not sick and any(self.running(i) for i in range(self.size)):
                return
            if time.monotonic() > deadline:
                logs = {
                    self.names[i]: (self.root / f"{self.names[i]}.log").read_text()[-2000:]
                    for i in sick
                    if (self.root / f"{self.names[i]}.log").exists()
                }
                raise AssertionError(f"etcd members {sick} not healthy after {timeout_s} s: {logs}")
            time.sleep(0.05)

    def close(self) -> None:
        for i in range(self.size):
            self.kill(i)


def _make_certificates(directory: Path) -> dict[str, str]:
    """A CA, etcd's server certificate (for 127.0.0.1) and a client certificate, with openssl."""
    directory.mkdir(parents=True, exist_ok=True)
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=directory, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=ca")
    for name, usage in (("server", "serverAuth"), ("client", "clientAuth")):
        (directory / f"{name}.ext").write_text(
            f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n"
        )
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext",
        )  # fmt: skip
    return {
        "ca_file": str(directory / "ca.crt"),
        "cert_file": str(directory / "client.crt"),
        "key_file": str(directory / "client.key"),
    }
