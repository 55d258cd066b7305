"""The etcd client for leadership: aetcd over one gRPC channel to every configured endpoint,
with a reconnect backoff tuned for a fast return after an etcd restart, and optional TLS with
a client certificate.

aetcd's Client opens an insecure channel to one host:port; ``EtcdClient`` overrides only the
channel: several endpoints become one gRPC target ("ipv4:A:P,B:P", pick_first: the next one
is tried when the current one fails), and ``ca_file``/``cert_file``/``key_file`` make it a
secure channel.  gRPC's default reconnect backoff (1 s growing to 120 s) adds seconds after
an etcd restart (measured 2.4 to 4.8 s); 100 to 500 ms brings it to 0.02 to 0.2 s.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import aetcd
from aetcd import rpc

from gossipd.config import EtcdConfig
from gossipd.errors import StartupError

GRPC_OPTIONS: dict[str, Any] = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 500,
    "grpc.keepalive_time_ms": 2000,
    "grpc.keepalive_timeout_ms": 1000,
    "grpc.keepalive_permit_without_calls": 1,
}


def grpc_target(endpoints: list[str]) -> str:
    """One endpoint: "host:port".  Several: "ipv4:A:P,B:P,..." (names resolved now, IPv4)."""
    if len(endpoints) == 1:
        return endpoints[0]
    addresses = []
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        try:
            ip = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        except OSError as exc:
            raise StartupError(f"etcd.endpoints: cannot resolve {endpoint!r}: {exc}") from None
        addresses.append(f"{ip}:{port}")
    return "ipv4:" + ",".join(addresses)


class EtcdClient(aetcd.Client):
    def __init__(self, config: EtcdConfig) -> None:
        super().__init__(timeout=config.request_timeout_s, options=GRPC_OPTIONS)
        self._target = grpc_target(config.endpoints)
        self._credentials = _credentials(config)

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        options = list(self._options.items())
        if self._credentials is None:
            self.channel = rpc.insecure_channel(self._target, options=options)
        else:
            self.channel = rpc.secure_channel(self._target, self._credentials, options=options)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd.watcher.Watcher(
            rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
        )
        self._connected.set()


def _credentials(config: EtcdConfig) -> Any:
    if not config.ca_file:
        return None
    import grpc

    def read(name: str, path: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise StartupError(f"cannot read etcd.{name} = {path!r}: {exc.strerror}") from None

    return grpc.ssl_channel_credentials(
        root_certificates=read("ca_file", config.ca_file),
        private_key=read("key_file", config.key_file) if config.key_file else None,
        certificate_chain=read("cert_file", config.cert_file) if config.cert_file else None,
    )
