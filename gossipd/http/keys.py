"""API keys for the HTTP door: one file per key in ``http.keys_dir``, ``NAME.key`` holding the
key on one line.  NAME is the producer's identity (token budgets, logs); a request proves it
with "Authorization: Bearer KEY".

Keys are kept as SHA-256 digests and looked up by digest: no comparison of the secret itself
whose time depends on how much of it matched.  ``reload`` reads the directory again when a
file was added, removed or changed (the daemon calls it every security.reload_interval_s and
on SIGHUP), so a removed key is refused from the next request on, without a restart.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from gossipd.keyfiles import OUT_OF_FILES, KeyFileError, is_key_file_name, read_small

log = logging.getLogger("gossipd.http.keys")

KEY_CHARS_MIN = 16  # shorter keys are refused at load: guessable
KEY_FILE_BYTES_MAX = 4096
_BLANKS = b" \t\r\n"  # trimmed around a key, in its file and in the header


class ApiKeys:
    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self._by_digest: dict[bytes, str] = {}
        # What the latest read saw; None: read at the next look, whatever it sees.
        self._seen: tuple[tuple[str, int, int, int, int], ...] | None = None
        self.reloads = 0
        self.unreadable = False  # the directory could not be read at the latest look
        self.reload(force=True, initial=True)

    def __len__(self) -> int:
        return len(self._by_digest)

    def name_of(self, authorization: str) -> str | None:
        """The key's name for an Authorization header value, or None (missing or unknown)."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        # The header's bytes as they came (it was read as latin-1): a key file's non-ASCII
        # key, UTF-8 there, is the same bytes on the wire.  ASCII blanks alone are trimmed,
        # as in the file: a str strip would take \xa0, the last byte of a UTF-8 "à".
        raw = token.encode("latin-1", "replace").strip(_BLANKS)
        return self._by_digest.get(hashlib.sha256(raw).digest())

    def reload(self, *, force: bool = False, initial: bool = False) -> bool:
        """Read the directory again if it changed (``force``: whether it did or not); True
        when the keys were read.  ``initial``: at start-up, where a directory that cannot be
        read stops it (OSError).  Later one that cannot be read (removed, its permissions
        taken away) leaves no key valid until it can be read again: revoking by removing the
        directory works, and nothing raises in the SIGHUP handler."""
        try:
            files = sorted(p for p in self.directory.iterdir() if is_key_file_name(p.name))
            seen = tuple((p.name, *_stamp(p)) for p in files)
        except OSError as exc:
            if initial:
                raise OSError(f"http.keys_dir {str(self.directory)!r}: {exc.strerror}") from None
            if exc.errno in OUT_OF_FILES:
                return self._kept(exc)
            if not self.unreadable:
                log.error(
                    "cannot read http.keys_dir: no API key is accepted until it can be read",
                    extra={"dir": str(self.directory), "error": exc.strerror},
                )
            self.unreadable = True
            self._by_digest = {}
            self._seen = ()
            return False
        self.unreadable = False
        if seen == self._seen and not force:
            return False
        keys: dict[bytes, str] = {}
        for path in files:
            try:
                raw = read_small(path, KEY_FILE_BYTES_MAX).strip(_BLANKS)
                token = raw.decode()  # UTF-8, or skipped
            except (OSError, KeyFileError, UnicodeDecodeError) as exc:
                if isinstance(exc, OSError) and exc.errno in OUT_OF_FILES and not initial:
                    return self._kept(exc)
                log.warning(
                    "skipped an unreadable API key file",
                    extra={"file": str(path), "error": str(exc)},
                )
                continue
            if b"\n" in raw:
                # Not taken as its first line (a comment above the key would become the
                # key), nor whole (unusable, silently, as before): refused and said.
                log.warning(
                    "skipped an API key file of more than one line: it must hold the key alone",
                    extra={"file": str(path)},
                )
                continue
            if len(token) < KEY_CHARS_MIN:
                log.warning(
                    f"skipped an API key shorter than {KEY_CHARS_MIN} characters",
                    extra={"file": str(path)},
                )
                continue
            keys[hashlib.sha256(raw).digest()] = path.stem
        self._by_digest = keys
        self._seen = seen
        self.reloads += 1
        log.info("API keys loaded", extra={"keys": len(keys), "dir": str(self.directory)})
        return True

    def _kept(self, exc: OSError) -> bool:
        """The process is out of file descriptors (a flood of connections): that says
        nothing of the keys, so they stay as they were, and the next look reads again."""
        log.warning(
            "cannot read http.keys_dir now (out of file descriptors): the keys stay as they were",
            extra={"dir": str(self.directory), "error": exc.strerror},
        )
        self._seen = None  # (read again at the next look: () is an empty directory's)
        return False


def _stamp(path: Path) -> tuple[int, int, int, int]:
    """A key file's (mtime, ctime, inode, size): what tells a change.  The ctime and the
    inode too, because a key rewritten with the same length and its mtime kept (``cp -p``,
    ``rsync -t``, ``tar x``) changes neither mtime nor size, and no one can set a ctime.  One
    that cannot be stat()ed (a dangling symlink, as a secret volume mid-update leaves; a file
    removed since the listing) is (-1, -1, -1, -1), and its read below skips and logs it: one
    bad entry is not the directory."""
    try:
        st = path.stat()
    except OSError:
        return -1, -1, -1, -1
    return st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_size
