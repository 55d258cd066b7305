"""CurveZMQ on every socket: this daemon's key pair, the authorised keys, the ZAP handler.

Who is who (docs/PROTOCOL.md, "Security"):
- Every daemon and every producer has its own CURVE key pair (``gossipd keygen``).
- A daemon serves its ingress PULL, gossip PULL and rpc ROUTER as a CURVE server with its own
  key pair.  The ZAP handler here admits a client only if its public key is in the directory
  for the socket's ZAP domain: ``security.peer_keys_dir`` for gossip and rpc
  (``DOMAIN_PEERS``), ``security.producer_keys_dir`` for ingress (``DOMAIN_PRODUCERS``).
- The ZAP handler names the client in each of its messages' ``User-Id`` property: for a peer,
  the node id its key file is named after (``NODE.key``), which the message's ``src`` must
  equal, a space and the key it proved (so that a connection opened with a key since
  replaced is refused, as one whose key was removed); for a producer, its public key in z85
  (40 characters).
- Replies go to a producer only over a connection whose server proves it holds the key the
  task came with: the daemon's reply PUSH is a CURVE client whose server key is the
  submitting producer's public key (the Task's ``producer_key``, set from ``User-Id``).
- Outgoing gossip and rpc connections check the server's key too: the key of the member that
  owns the address (learnt from the membership table, or a seed's ``NODE@`` name).

Keys are re-read when a key directory changes (polled every ``reload_interval_s``) and on
SIGHUP.  A removed key cannot start a connection (ZAP), and messages on connections it had
opened are refused from then on (the readers check ``User-Id`` against the current keys).
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import os
import stat
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from gossipd.errors import StartupError
from gossipd.keyfiles import KEY_SUFFIX, OUT_OF_FILES, is_key_file_name, read_key_file
from gossipd.ops.logs import RateLimiter
from gossipd.zmqloop import NOBLOCK, SocketReader, kick
from gossipd.zmtp import PeerCurve

log = logging.getLogger("gossipd.security")

DOMAIN_PEERS = "gossipd-peers"
DOMAIN_PRODUCERS = "gossipd-producers"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
PUBLIC_SUFFIX = KEY_SUFFIX
SECRET_SUFFIX = ".key_secret"


@dataclass(frozen=True, slots=True)
class KeyPair:
    public: bytes  # z85, 40 bytes
    secret: bytes  # z85, 40 bytes


def load_key_pair(path: str | Path) -> KeyPair:
    """A ``NAME.key_secret`` file (``gossipd keygen``, zmq.auth's format); StartupError
    saying what to do when it cannot be read."""
    try:
        public, secret = read_key_file(path)
    except PermissionError as exc:  # (made, but not for this user: keygen would replace it)
        raise StartupError(
            f"cannot read the key pair {str(path)!r}: {exc.strerror}: it is not readable by "
            f"this user (uid {os.geteuid()}); give the daemon's group read access: "
            f"`chgrp gossipd {path} && chmod 0640 {path}`, its directory searchable by it"
        ) from None
    except FileNotFoundError:
        raise StartupError(
            f"cannot read the key pair {str(path)!r}: no such file "
            "(make one with `gossipd keygen NAME --out DIR`)"
        ) from None
    except (OSError, ValueError) as exc:  # (each names the file)
        raise StartupError(f"cannot read the key pair: {exc}") from None
    if not secret:
        raise StartupError(
            f"{str(path)!r} holds no secret key: give the NAME.key_secret file, not NAME.key"
        )
    if os.stat(path).st_mode & stat.S_IROTH:
        raise StartupError(
            f"the secret key {str(path)!r} is readable by every user, any of whom could speak "
            f"as this daemon: `chmod 0600 {path}` (or 0640 with the daemon's group: "
            f"`chgrp gossipd {path} && chmod 0640 {path}`)"
        )
    if zmq.curve_public(secret) != public:
        raise StartupError(
            f"{str(path)!r}: its public-key line is not the public key of its secret key "
            "(edited by hand?): every handshake would fail.  Make a new pair with `gossipd "
            "keygen NAME --out DIR` and give peers its NAME.key"
        )
    return KeyPair(public, secret)


def write_key_pair(name: str, out_dir: str | Path) -> tuple[Path, Path]:
    """``NAME.key`` (public, to distribute) and ``NAME.key_secret`` (mode 0600 from its
    creation: it never exists readable by others, and a link in its place is refused) in
    ``out_dir`` (made 0700 when missing), in zmq.auth's format; refuses to overwrite."""
    problem = key_name_problem(name)
    if problem is not None:
        raise ValueError(problem)
    out = Path(out_dir)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = out / f"{name}{PUBLIC_SUFFIX}", out / f"{name}{SECRET_SUFFIX}"
    for path in (public, secret):
        if path.exists() or path.is_symlink():
            raise FileExistsError(f"{path} exists; remove it first to replace the key")
    public_key, secret_key = (key.decode() for key in zmq.curve_keypair())
    now = datetime.datetime.now().isoformat(timespec="seconds")
    _write_new(
        secret,
        f"#   ****  Generated on {now} by gossipd keygen  ****\n"
        "#   ZeroMQ CURVE **Secret** Certificate\n"
        "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.\n\n"
        f'metadata\ncurve\n    public-key = "{public_key}"\n    secret-key = "{secret_key}"\n',
        0o600,
    )
    try:
        _write_public(public, public_key, now)
    except BaseException:
        secret.unlink(missing_ok=True)  # (a lone secret would block keygen's next try)
        raise
    return public, secret


def key_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a key pair's files, or None."""
    if not name or "/" in name or name.startswith(".") or "\0" in name:
        return f"{name!r}: a key's name is a file name (no '/', not starting with '.')"
    return None


def _write_public(public: Path, public_key: str, now: str) -> None:
    _write_new(
        public,
        f"#   ****  Generated on {now} by gossipd keygen  ****\n"
        "#   ZeroMQ CURVE Public Certificate\n"
        "#   Exchange securely, or use a secure mechanism to verify the contents\n"
        "#   of this file after exchange. Store public certificates in your home\n"
        "#   directory, in the .curve subdirectory.\n\n"
        f'metadata\ncurve\n    public-key = "{public_key}"\n',
        0o644,
    )


def _write_new(path: Path, text: str, mode: int) -> None:
    """``text`` in a file made now with ``mode`` (the umask may only narrow it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
    except BaseException:
        path.unlink(missing_ok=True)  # (not half a key: a full disk)
        raise


def node_of(user_id: str) -> str:
    """The node of a peer's user id ("NODE KEY": KeyDir's for peers).  Split at the last
    space: a Z85 key has none, a node id may."""
    return user_id.rpartition(" ")[0]


class KeyDir:
    """Authorised public keys: the ``*.key`` files of one directory, each named after whom
    it admits.  ``user_id(key)``: the name to give a client with this key (None: refused):
    the key itself (producers), or "NODE KEY" (peers: ``node_of`` reads the node)."""

    def __init__(self, path: str | Path, *, user_is_key: bool) -> None:
        self.path = Path(path)
        self._user_is_key = user_is_key  # producers: User-Id is the z85 key itself
        self._signature: tuple[tuple[str, int, int, int, int], ...] | None = None
        self.by_key: dict[bytes, str] = {}  # z85 public key -> user id
        self.users: frozenset[str] = frozenset()
        self.by_name: dict[str, bytes] = {}  # file stem -> z85 public key
        self.reloads = 0
        self.bad_files = 0
        self._unreadable: int | None = None  # the errno of a directory that cannot be read
        self.reload()

    def _scan(self) -> tuple[tuple[str, int, int, int, int], ...]:
        """Each key file's (name, mtime, ctime, inode, size): a public key is always 40
        characters, so a key replaced with its mtime kept (``cp -p``, ``rsync -t``) changes
        no size and no mtime; its ctime (which no one can set) and inode do."""
        try:
            entries = sorted(os.scandir(self.path), key=lambda e: e.name)
        except OSError as exc:
            if exc.errno in OUT_OF_FILES:
                raise
            if self._unreadable != exc.errno:  # (said once, not at every look)
                self._unreadable = exc.errno
                log.error(
                    "a key directory cannot be read: no key in it is taken (every client or "
                    "peer it would admit is refused) until it can",
                    extra={"path": str(self.path), "error": exc.strerror, "uid": os.geteuid()},
                )
            return ()
        if self._unreadable is not None:
            self._unreadable = None
            log.info("the key directory can be read again", extra={"path": str(self.path)})
        out = []
        for entry in entries:
            if is_key_file_name(entry.name):
                try:
                    st = entry.stat()
                except OSError:
                    continue
                out.append((entry.name, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_size))
        return tuple(out)

    def reload(self, *, force: bool = False) -> bool:
        """Re-read the directory if its files changed (or ``force``); True if it did.  Out
        of file descriptors (a flood of connections) says nothing of the keys: they stay as
        they were, and the next look reads again."""
        try:
            return self._reload(force)
        except OSError as exc:  # (only EMFILE / ENFILE come out of _reload)
            log.warning(
                "cannot read a key directory now (out of file descriptors): its keys stay",
                extra={"dir": str(self.path), "error": exc.strerror},
            )
            self._signature = None
            return False

    def _reload(self, force: bool) -> bool:
        signature = self._scan()
        if signature == self._signature and not force:
            return False
        by_key: dict[bytes, str] = {}
        by_name: dict[str, bytes] = {}
        for name, *_ in signature:
            try:
                public, _ = read_key_file(self.path / name)
            except (OSError, ValueError) as exc:  # (KeyFileError is a ValueError)
                if isinstance(exc, OSError) and exc.errno in OUT_OF_FILES:
                    raise
                self.bad_files += 1
                log.warning("cannot read a key file", extra={"file": name, "error": str(exc)})
                continue
            stem = name[: -len(PUBLIC_SUFFIX)]
            by_name[stem] = public
            by_key[public] = public.decode() if self._user_is_key else f"{stem} {public.decode()}"
        if not self._user_is_key and len(by_key) < len(by_name):
            # One key under two members' names (a botched rotation): whoever holds it would
            # be whichever name sorts last.  Neither name gets it; the files stay named.
            named: dict[bytes, list[str]] = {}
            for stem, public in by_name.items():
                named.setdefault(public, []).append(stem)
            for public, stems in named.items():
                if len(stems) > 1:
                    self.bad_files += len(stems)
                    log.warning(
                        "one public key in several members' key files: refused for all of "
                        "them until one is removed or replaced",
                        extra={"files": [f"{s}{PUBLIC_SUFFIX}" for s in stems]},
                    )
                    del by_key[public]
                    for stem in stems:
                        del by_name[stem]
        self._signature = signature
        self.by_key, self.by_name = by_key, by_name
        self.users = frozenset(by_key.values())
        self.reloads += 1
        return True

    def user_id(self, public_z85: bytes) -> str | None:
        return self.by_key.get(public_z85)


class ZapHandler:
    """The ZAP endpoint of one ZeroMQ context, read in its fd callback on the event loop:
    admits a CURVE client whose key is in its ZAP domain's directory, refuses anyone else
    (counted by domain and reason, logged at most ``refused_lines_per_s``)."""

    def __init__(
        self, ctx: zmq.Context, domains: dict[str, KeyDir], refused_lines_per_s: float
    ) -> None:
        self._domains = domains
        self.refused: Counter[tuple[str, str]] = Counter()  # (domain, reason)
        self.admitted: Counter[str] = Counter()
        self._log = RateLimiter(refused_lines_per_s)
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)  # before any CURVE server binds
        self._reader: SocketReader | None = None

    def start(self) -> None:
        """Answer requests from now on (in the running loop)."""
        sock = self._sock
        self._reader = SocketReader(sock, sock.recv_multipart, 64, self._on_requests)

    def _on_requests(self, requests: list[list[bytes]]) -> None:
        for parts in requests:
            # [routing id, b"", version, request id, domain, address, identity, mechanism,
            #  credentials...] (ZMTP RFC 27)
            if len(parts) < 8:
                continue
            self._sock.send_multipart(self._answer(parts), NOBLOCK)
        kick(self._sock)

    def _answer(self, parts: list[bytes]) -> list[bytes]:
        domain = parts[4].decode("utf-8", "replace")
        address = parts[5].decode("utf-8", "replace")
        mechanism = parts[7] if len(parts) >= 9 else b""
        user = self.decide(domain, mechanism, parts[8] if len(parts) > 8 else b"", address)
        head = [parts[0], b"", b"1.0", parts[3]]
        if user is not None:
            return [*head, b"200", b"OK", user.encode(), b""]
        return [*head, b"400", b"unknown key", b"", b""]

    def decide(self, domain: str, mechanism: bytes, key: bytes, address: str) -> str | None:
        """The user a client with ``key`` (32 raw bytes) is in ``domain``, or None (refused,
        counted and logged): ZAP's answer, and the loop peer channel's (looppeer.py)."""
        keys = self._domains.get(domain)
        user: str | None = None
        if mechanism != b"CURVE" or len(key) != 32:
            reason = "mechanism"
        elif keys is None:
            reason = "domain"
        else:
            user = keys.user_id(z85.encode(key))
            reason = "unknown_key"
        if user is not None:
            self.admitted[domain] += 1
            return user
        self.refused[(domain, reason)] += 1
        if self._log.allow():
            log.warning(
                "refused a connection",
                extra={
                    "domain": domain,
                    "reason": reason,
                    "address": address,
                    "key": z85.encode(key).decode() if len(key) == 32 else "",
                    "suppressed_since_last": self._log.take_suppressed(),
                },
            )
        return None

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._sock.close(linger=0)


@dataclass(slots=True)
class SecurityCounters:
    # Messages on an open connection whose key was revoked since (refused by readers).
    revoked_messages: dict[str, int]
    # Peer messages whose source is not the node their key belongs to, by channel.
    src_mismatch: dict[str, int]


class Security:
    """One daemon's CURVE state: its key pair, the authorised keys, the ZAP handler, and how
    to set up server and client sockets.  ``curve`` False: every method is a no-op."""

    def __init__(
        self,
        *,
        curve: bool,
        ctx: zmq.Context,
        key_pair: KeyPair | None = None,
        peer_keys_dir: str = "",
        producer_keys_dir: str = "",
        refused_lines_per_s: float = 5.0,
        node_at: Callable[[str], str | None] = lambda addr: None,
    ) -> None:
        self.curve = curve
        self.key_pair = key_pair
        self.peers = KeyDir(peer_keys_dir, user_is_key=False) if curve else None
        self.producers = KeyDir(producer_keys_dir, user_is_key=True) if curve else None
        self.counters = SecurityCounters(revoked_messages=Counter(), src_mismatch=Counter())
        self.zap: ZapHandler | None = None
        self._src_log = RateLimiter(refused_lines_per_s)
        # Address -> node, for the server key of an outgoing gossip or rpc connection (the
        # membership table and named seeds).
        self.node_at = node_at
        if curve:
            assert self.peers is not None and self.producers is not None
            for what, keys in (
                ("peer_keys_dir", self.peers),
                ("producer_keys_dir", self.producers),
            ):
                if not keys.path.is_dir():
                    raise StartupError(
                        f"security.{what} = {str(keys.path)!r} is not a directory "
                        "(put the authorised NAME.key files there)"
                    )
            self.zap = ZapHandler(
                ctx,
                {DOMAIN_PEERS: self.peers, DOMAIN_PRODUCERS: self.producers},
                refused_lines_per_s,
            )

    def start(self) -> None:
        if self.zap is not None:
            self.zap.start()

    def close(self) -> None:
        if self.zap is not None:
            self.zap.close()

    # -- sockets -------------------------------------------------------------------------

    def serve(self, sock: zmq.Socket, domain: str) -> None:
        """Make ``sock`` (before it binds) a CURVE server whose clients ZAP checks in
        ``domain``."""
        if not self.curve:
            return
        assert self.key_pair is not None
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.key_pair.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.key_pair.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())

    def loop_peer_curve(self, domain: str = DOMAIN_PEERS) -> PeerCurve | None:
        """CURVE for the loop's sockets (looppeer.py, looppull.py), as ``serve``/the socket
        pool set it up for ZeroMQ: this daemon's keys, the member at an address's key, and
        ZAP's decision in ``domain`` (counted with ZAP's) on a client's key; None without
        CURVE."""
        if not self.curve:
            return None
        assert self.key_pair is not None and self.zap is not None
        zap = self.zap

        def server_key(addr: str) -> bytes | None:
            key = self.peer_server_key(addr)
            return None if key is None else z85.decode(key)  # (KeyDir read only Z85 keys)

        return PeerCurve(
            z85.decode(self.key_pair.public),
            z85.decode(self.key_pair.secret),
            server_key=server_key,
            authorize=lambda key, address: zap.decide(domain, b"CURVE", key, address),
        )

    def peer_server_key(self, addr: str) -> bytes | None:
        """The key the member serving ``addr`` must prove it holds (None: no member we know
        of, or no key for it)."""
        assert self.peers is not None
        node = self.node_at(addr)
        return None if node is None else self.peers.by_name.get(node)

    # -- per message ---------------------------------------------------------------------

    def producer_allowed(self, user_id: str, messages: int = 1) -> bool:
        """``messages`` from producer ``user_id`` (its z85 key) on an open connection: is
        its key still authorised?  (If not, each is counted revoked.)"""
        assert self.producers is not None
        if user_id in self.producers.users:
            return True
        self.counters.revoked_messages[DOMAIN_PRODUCERS] += messages
        return False

    def is_peers_key(self, node: str, public_z85: str) -> bool:
        """Is ``public_z85`` the key of member ``node`` (in security.peer_keys_dir)?"""
        assert self.peers is not None
        user = self.peers.by_key.get(public_z85.encode()) if public_z85 else None
        return user is not None and node_of(user) == node

    def peer_key_allowed(self, user_id: str) -> bool:
        """A message from a member on a connection authenticated as ``user_id`` ("NODE
        KEY") that names no source (a reply to the HTTP door): is that key still the
        node's?"""
        assert self.peers is not None
        if user_id in self.peers.users:
            return True
        self.counters.revoked_messages[DOMAIN_PEERS] += 1
        return False

    def peer_allowed(self, user_id: str, src: str, channel: str) -> bool:
        """A message claiming to come from node ``src``, on a connection authenticated as
        ``user_id`` ("NODE KEY"): its key still the node's, and speaking for itself?"""
        if not self.peer_key_allowed(user_id):  # (the key removed, or the node's replaced)
            return False
        node = node_of(user_id)
        if src == node:
            return True
        self.counters.src_mismatch[channel] += 1
        if self._src_log.allow():
            log.warning(
                "refused a peer message whose source is not its key's node",
                extra={
                    "channel": channel,
                    "src": src[:128],
                    "key_node": node,
                    "suppressed_since_last": self._src_log.take_suppressed(),
                },
            )
        return False

    # -- reloading -----------------------------------------------------------------------

    def reload(self, *, force: bool = False) -> bool:
        changed = False
        for keys in (self.peers, self.producers):
            if keys is not None and keys.reload(force=force):
                changed = True
                log.info(
                    "authorised keys loaded",
                    extra={"directory": str(keys.path), "keys": len(keys.by_key)},
                )
        return changed

    async def watch_forever(
        self, interval_s: float, on_tick: Callable[[bool], None] | None = None
    ) -> None:
        """Reload every ``interval_s``; ``on_tick(peers_changed)`` after each look."""
        while True:
            await asyncio.sleep(interval_s)
            self.reload_and_tell(on_tick)

    def reload_and_tell(
        self, on_tick: Callable[[bool], None] | None = None, *, force: bool = False
    ) -> None:
        assert self.peers is not None
        before = self.peers.reloads
        self.reload(force=force)
        if on_tick is not None:
            on_tick(self.peers.reloads != before)


def is_loopback(endpoint: str) -> bool:
    """True for ipc:// and inproc:// endpoints and tcp:// on a loopback address or
    "localhost"; False for wildcards and every other host."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    return is_loopback_host(endpoint.removeprefix("tcp://").rpartition(":")[0])


def is_wildcard_host(host: str) -> bool:
    """True for "*" or an unspecified address (0.0.0.0, ::, bracketed or not, any spelling):
    a bind to every interface, which names no host that another can connect to."""
    host = host.strip("[]")
    if host == "*":
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def is_loopback_host(host: str) -> bool:
    """True for a loopback address (bracketed or not) or "localhost"; a wildcard or another
    name is not."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
