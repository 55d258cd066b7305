"""Exceptions that say whose fault an error is.

- ``LocalProtocolError``: our own caller misused an API (a bug on this side).
- ``RemoteProtocolError``: a peer or producer sent something bad. It carries the wire error
  code to answer with, a hint for the human reading the log, and (when it could be read from
  the broken message) where to send that answer.
- ``TransportClosed`` / ``TransportBroken``: we closed a transport / the peer or network did.
- ``ConfigError``: a configuration file, variable or flag is wrong; one line says which.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Abstract base: instantiate ``LocalProtocolError`` or ``RemoteProtocolError``."""

    def __new__(cls, *args: object, **kwargs: object) -> ProtocolError:
        if cls is ProtocolError:
            raise TypeError("ProtocolError is abstract; raise a Local- or RemoteProtocolError")
        return super().__new__(cls)


class LocalProtocolError(ProtocolError):
    """Our caller broke a rule of the API."""


class RemoteProtocolError(ProtocolError):
    """A remote party sent something we refuse.

    ``code`` is the wire error code (see ``gossipd.core.messages.ErrorCode``); ``reason`` the
    label it is counted under (the code unless a finer one applies, e.g. ``oversized``);
    ``reply_to`` and ``task_id`` are filled when they could be recovered from the refused
    message, so the producer can be told why.
    """

    def __init__(
        self,
        hint: str,
        *,
        code: str,
        peer: str = "",
        reply_to: str = "",
        task_id: str = "",
        reason: str = "",
    ) -> None:
        super().__init__(hint)
        self.hint = hint
        self.code = code
        self.reason = reason or code
        self.peer = peer
        self.reply_to = reply_to
        self.task_id = task_id


class TransportClosed(Exception):
    """We closed this transport; using it again is a local bug."""


class TransportBroken(Exception):
    """The peer or the network broke the transport."""


class ConfigError(Exception):
    """A bad configuration: the message names the source, the key, what was found and expected."""


class StartupError(Exception):
    """The daemon cannot start (an address in use, an unwritable journal); one line says why."""
