"""A CURVE key layout for local clusters (benchmarks, simulations): one key pair per daemon and
per producer under ``root/secrets``, the public keys in ``root/peers`` and ``root/producers``,
as docs/OPERATIONS.md lays them out on real nodes."""

from __future__ import annotations

from pathlib import Path

from gossipd.keyfiles import read_key_file
from gossipd.security import write_key_pair


class CurveLayout:
    def __init__(self, root: str | Path, *, nodes: list[str], producers: list[str]) -> None:
        self.root = Path(root)
        self.secrets = self.root / "secrets"
        self.peers = self.root / "peers"
        self.producers = self.root / "producers"
        for folder in (self.peers, self.producers):
            folder.mkdir(parents=True, exist_ok=True)
        for name in nodes:
            self.add(name, self.peers)
        for name in producers:
            self.add(name, self.producers)

    def add(self, name: str, authorise_in: Path) -> None:
        public, _ = write_key_pair(name, self.secrets)
        (authorise_in / public.name).write_bytes(public.read_bytes())

    def pair(self, name: str) -> tuple[bytes, bytes]:
        """(public, secret), z85."""
        public, secret = read_key_file(self.secrets / f"{name}.key_secret")
        assert secret is not None
        return public, secret

    def public(self, name: str) -> bytes:
        return self.pair(name)[0]

    def overrides(self, node: str) -> list[str]:
        """The --set items that run daemon ``node`` with CURVE on this layout."""
        return [
            "security.curve=true",
            f'security.secret_key_file="{self.secrets / f"{node}.key_secret"}"',
            f'security.peer_keys_dir="{self.peers}"',
            f'security.producer_keys_dir="{self.producers}"',
        ]
