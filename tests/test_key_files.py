"""An operator's key files going wrong (a review of the operator's tools: each of these hung,
gave a traceback or named the wrong thing before): a malformed key, the public file given
as the secret one, keygen's names and files, and files or directories the daemon's user
cannot read.  Real commands, real files; as root, the daemon's user is `nobody` (a forked child)."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gossipd.config import Config, load_config
from gossipd.errors import StartupError
from gossipd.keyfiles import KeyFileError, read_key_file
from gossipd.ops import preflight
from gossipd.security import write_key_pair
from tests.helpers import gossipd_cli


def test_a_key_that_is_not_40_characters_of_z85_is_refused_naming_its_file(tmp_path: Path) -> None:
    good = write_key_pair("a", tmp_path)[1]
    public, secret = read_key_file(good)
    assert len(public) == 40 and secret is not None and len(secret) == 40
    for name, text, said in (
        ("short.key", 'public-key = "abc"\n', "public-key: a key of 3 characters"),
        ("tilde.key", f'public-key = "{"~" * 40}"\n', "public-key: 40 characters that are no"),
        ("s.key_secret", f'public-key = "{public.decode()}"\nsecret-key = "x"\n', "secret-key"),
    ):
        (tmp_path / name).write_text(text)
        with pytest.raises(KeyFileError, match=said) as refused:
            read_key_file(tmp_path / name)
        assert name in str(refused.value)


def test_status_with_a_malformed_server_key_says_so_and_exits_instead_of_hanging(
    tmp_path: Path,
) -> None:
    """The key reached ZeroMQ's setsockopt, which refused it after the socket was made and
    before it was kept for closing: the context's term then waited for it for ever."""
    secret = write_key_pair("ops", tmp_path)[1]
    (tmp_path / "bad.key").write_text('public-key = "abc"\n')
    out = gossipd_cli(
        "status", "-e", "tcp://127.0.0.1:9", "--secret-key", str(secret),
        "--server-key", str(tmp_path / "bad.key"), "--timeout", "1", timeout_s=30,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "bad.key" in out.stderr and "a key of 3 characters" in out.stderr
    public = secret.with_name("ops.key")
    given_public = gossipd_cli(
        "submit", "-e", "tcp://127.0.0.1:9", "--secret-key", str(public), "--server-key",
        str(public), "hello", timeout_s=30,
    )  # fmt: skip
    assert given_public.returncode == 2 and "Traceback" not in given_public.stderr
    assert "holds no secret key" in given_public.stderr


def test_keygen_makes_the_secret_0600_from_the_start_and_refuses_names_links_and_files(
    tmp_path: Path,
) -> None:
    """The secret was written under the umask and chmodded after (readable by others in
    between, and left so by an interrupted run); a link in its place was followed; a name
    with '/' wrote outside --out; a file as --out gave a traceback."""
    out = tmp_path / "keys"
    made = subprocess.run(
        [sys.executable, "-c", "import os, sys; os.umask(0); from gossipd.tools.cli import "
         "main; sys.exit(main(['keygen', 'k', '--out', sys.argv[1]]))", str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert stat.S_IMODE((out / "k.key_secret").stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "k.key").stat().st_mode) == 0o644
    (out / "l.key_secret").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "afile").write_text("")
    for args, said in (
        (["l", "--out", str(out)], "exists"),
        (["a/b", "--out", str(out)], "a key's name is a file name"),
        (["../up", "--out", str(out)], "a key's name is a file name"),
        (["x", "--out", str(tmp_path / "afile")], "File exists"),
    ):
        refused = gossipd_cli("keygen", *args)
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "up.key").exists()
    # A bad name among good ones: nothing written (the good ones were, before it).
    mixed = gossipd_cli("keygen", "m1", "m2", "bad/name", "--out", str(out))
    assert mixed.returncode == 2 and not (out / "m1.key").exists()


def _check_as_the_daemons_user(settings: list[str]) -> str:
    """`check-config`'s checks (preflight.check) as a user that is not root: "" when they
    pass, else what they say.  As root, in a child forked and turned `nobody`, which reads
    nothing of the checkout (that may be unreadable to it: gossipd is imported before)."""
    config = load_config(None, overrides=settings)
    if os.geteuid() != 0:
        return _checked(config)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # (the child: no return from here)
        try:
            os.close(read)
            nobody = pwd.getpwnam("nobody")
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            os.write(write, _checked(config).encode() or b"")
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        said = answer.read().decode()
    os.waitpid(pid, 0)
    return said


def _checked(config: Config) -> str:
    try:
        preflight.check(config, "n1")
    except StartupError as exc:
        return str(exc)
    except BaseException as exc:  # (what the operator would see as a traceback)
        return f"raised {type(exc).__name__}: {exc}"
    return ""


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory that another user can reach (pytest's tmp_path is under a 0700 one)."""
    path = Path(tempfile.mkdtemp(prefix="gossipd-keys-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_check_config_says_which_key_file_or_directory_the_daemons_user_cannot_read(
    open_dir: Path,
) -> None:
    """A key directory that cannot be listed was read as empty (every peer refused, no word
    said) or raised PermissionError out of run; an unreadable secret key file was blamed on
    a missing key pair, whose advice (keygen) replaces a key the peers hold."""
    tmp_path = open_dir
    keys = tmp_path / "keys"
    secret = write_key_pair("n1", keys)[1]
    keys.chmod(0o755)
    for name in ("peers", "producers"):
        (tmp_path / name).mkdir(mode=0o755)
    settings = [
        "security.curve=true",
        f'security.peer_keys_dir="{tmp_path / "peers"}"',
        f'security.producer_keys_dir="{tmp_path / "producers"}"',
        f'security.secret_key_file="{secret}"',
    ]
    unreadable = _check_as_the_daemons_user(settings)  # the secret: 0600, not its user's
    assert "not readable by this user" in unreadable and "chmod 0640" in unreadable, unreadable
    assert "keygen" not in unreadable
    secret.chmod(0o644)  # readable by it, and by every user: refused
    everyone = _check_as_the_daemons_user(settings)
    assert "readable by every user" in everyone and "chmod 0600" in everyone, everyone
    if os.geteuid() == 0:  # (the daemon's user is `nobody`: give the key to its group)
        os.chown(secret, -1, pwd.getpwnam("nobody").pw_gid)
    secret.chmod(0o640)
    assert _check_as_the_daemons_user(settings) == ""
    (tmp_path / "peers").chmod(0o757)  # writable by every user: anyone adds a key
    open_to_all = _check_as_the_daemons_user(settings)
    assert "security.peer_keys_dir" in open_to_all and "writable by every user" in open_to_all
    (tmp_path / "peers").chmod(0o755)
    (tmp_path / "peers").chmod(0o711)  # searchable, not listable
    unlisted = _check_as_the_daemons_user(settings)
    assert "security.peer_keys_dir" in unlisted and "cannot be listed" in unlisted, unlisted
    (tmp_path / "peers").chmod(0o700)  # neither
    closed = _check_as_the_daemons_user(settings)
    assert "cannot be listed" in closed and not closed.startswith("raised"), closed


def test_a_key_directory_skips_fifos_and_files_every_user_may_write(tmp_path: Path) -> None:
    """A FIFO named NAME.key blocked the reload (on the event loop: every handshake with
    it) for as long as nobody wrote to it; a key file any user may write let any user put
    a key of their own there.  Both are skipped, said and counted; the others load."""
    import threading

    from gossipd.http.keys import ApiKeys
    from gossipd.security import KeyDir

    peers = tmp_path / "peers"
    write_key_pair("good", tmp_path / "made")
    peers.mkdir()
    shutil.copy(tmp_path / "made" / "good.key", peers / "good.key")
    shutil.copy(tmp_path / "made" / "good.key", peers / "open.key")
    (peers / "open.key").chmod(0o666)
    os.mkfifo(peers / "pipe.key")
    dirs: list[KeyDir] = []  # (it reads its directory as it is made)
    loaded = threading.Thread(target=lambda: dirs.append(KeyDir(peers, user_is_key=False)))
    loaded.daemon = True
    loaded.start()
    loaded.join(10)
    _release_readers(peers / "pipe.key")
    assert dirs, "reading the key directory blocked on the FIFO"
    keydir = dirs[0]
    assert sorted(keydir.by_name) == ["good"] and keydir.bad_files == 2
    with pytest.raises(KeyFileError, match="writable by every user"):
        read_key_file(peers / "open.key")

    api = tmp_path / "api"
    api.mkdir()
    (api / "alice.key").write_text("sk-alice-0123456789abcdef\n")
    (api / ".bob.key").write_text("sk-bob-0123456789abcdef0\n")  # hidden: switched off
    os.mkfifo(api / "pipe.key")
    keys: list[ApiKeys] = []
    made = threading.Thread(target=lambda: keys.append(ApiKeys(str(api))), daemon=True)
    made.start()
    made.join(10)
    _release_readers(api / "pipe.key")
    assert keys, "reading the API keys blocked on the FIFO"
    assert keys[0].name_of("Bearer sk-alice-0123456789abcdef") == "alice"
    assert keys[0].name_of("Bearer sk-bob-0123456789abcdef0") is None
    assert len(keys[0]) == 1


def _release_readers(fifo: Path) -> None:
    """Open the FIFO for writing and close it: a reader blocked in its open (before the
    fix) goes on, and the test process can end."""
    with contextlib.suppress(OSError):  # (ENXIO: no reader waits)
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_a_key_pair_whose_public_line_is_not_its_secrets_key_is_refused(tmp_path: Path) -> None:
    from gossipd.security import load_key_pair

    _, secret = write_key_pair("a", tmp_path)
    other, _ = write_key_pair("b", tmp_path)
    lines = secret.read_text().splitlines()
    other_public = next(x for x in other.read_text().splitlines() if "public-key" in x)
    secret.write_text("\n".join(other_public if "public-key" in x else x for x in lines))
    with pytest.raises(StartupError, match="not the public key of its secret key"):
        load_key_pair(secret)
