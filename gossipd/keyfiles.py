"""CURVE key files as docs/PROTOCOL.md ("Key files") defines them, read by our own reader.

pyzmq's ``zmq.auth.load_certificate`` writes and reads the same lines, but it takes the last
``public-key`` line of a file where the document says the first, and a ``public-key`` line
without ``=`` raises IndexError, which the key directories' reload (in the daemon's task
group) did not expect: one bad file dropped into ``producer_keys_dir`` ended the daemon.
Here every fault of a file is a KeyFileError saying what is wrong with it.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from pathlib import Path

from zmq.utils import z85

# A key directory's read that failed for lack of file descriptors (a flood of connections):
# it says nothing of the keys, so the directories (security.KeyDir, http/keys.ApiKeys) keep
# theirs and read again at their next look.
OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)

_QUOTES_AND_SPACE = b" \t'\""
Z85_KEY_CHARS = 40  # a CURVE key (32 bytes) in Z85
KEY_SUFFIX = ".key"  # a key directory's files: NAME.key (a public key, or an API key)


def is_key_file_name(name: str) -> bool:
    """A key directory's ``NAME.key``, not hidden: a key is switched off by hiding it."""
    return name.endswith(KEY_SUFFIX) and not name.startswith(".")


class KeyFileError(ValueError):
    """A key file that cannot be read, or holds no key where one is needed."""


def read_key_file(path: str | Path) -> tuple[bytes, bytes | None]:
    """The (public, secret) z85 keys of a key file: each line stripped of surrounding
    whitespace, ``#`` lines skipped, the first line starting with ``public-key`` (and
    ``secret-key``) giving its key: what follows its first ``=``, with spaces, tabs and
    quotes stripped from both ends.  OSError when the file cannot be opened; KeyFileError
    when it has no public key, a key line without ``=``, or a key that is not 40 characters
    of Z85 (a bad key given to ZeroMQ failed far from the file: a command's socket refused
    "Invalid argument", and a hung `gossipd status` closing it)."""
    data = read_small(path, 1 << 16)  # (a key file is a few hundred bytes)
    try:
        return _keys_in(data)
    except KeyFileError as exc:
        raise KeyFileError(f"{str(path)!r}: {exc}") from None


def read_small(path: str | Path, bytes_max: int) -> bytes:
    """At most ``bytes_max`` bytes of the regular file at ``path`` (a link to one is fine:
    a Kubernetes secret's).  KeyFileError for what a key file must not be: a FIFO or a
    device (opened non-blocking and refused, where a plain open or read blocked the event
    loop, and with it every handshake), or a file any user may write (any user could put
    a key of its own there).  OSError when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise KeyFileError(f"{str(path)!r} is not a regular file")
        if mode & stat.S_IWOTH:
            raise KeyFileError(
                f"{str(path)!r} is writable by every user, who could put a key of their own "
                f"there: `chmod o-w {path}`"
            )
        return os.read(fd, bytes_max)
    finally:
        os.close(fd)


def _keys_in(data: bytes) -> tuple[bytes, bytes | None]:
    public: bytes | None = None
    secret: bytes | None = None
    for number, raw in enumerate(data.splitlines(), 1):
        line = raw.strip()
        if line.startswith(b"#"):
            continue
        for name in (b"public-key", b"secret-key"):
            if not line.startswith(name):
                continue
            _, equals, value = line.partition(b"=")
            if not equals:
                raise KeyFileError(f"line {number}: {name.decode()} without '=' and its key")
            if name == b"public-key" and public is None:
                public = value.strip(_QUOTES_AND_SPACE)
            elif name == b"secret-key" and secret is None:
                secret = value.strip(_QUOTES_AND_SPACE)
    if public is None:
        raise KeyFileError("no public-key line")
    _check_key("public-key", public)
    if secret is not None:
        _check_key("secret-key", secret)
    return public, secret


def _check_key(name: str, key: bytes) -> None:
    if len(key) != Z85_KEY_CHARS:
        raise KeyFileError(f"{name}: a key of {len(key)} characters, not {Z85_KEY_CHARS} (Z85)")
    try:
        z85.decode(key)
    except (KeyError, ValueError, struct.error):
        raise KeyFileError(f"{name}: 40 characters that are no Z85 key") from None
