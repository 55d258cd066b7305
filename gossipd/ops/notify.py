"""systemd notification (sd_notify) over the unix datagram socket in $NOTIFY_SOCKET.

READY=1 once serving, STOPPING=1 when shutdown begins, WATCHDOG=1 every half of
$WATCHDOG_USEC.  Without NOTIFY_SOCKET every call does nothing (not started by systemd).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("gossipd.ops.notify")


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):  # abstract namespace
            address = "\0" + address[1:]
        self._address = address
        self._sock: socket.socket | None = None
        if address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
        usec = env.get("WATCHDOG_USEC", "")
        self.watchdog_interval_s: float | None = (
            int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 else None
        )
        self.sent = 0

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, state: str) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto(state.encode(), self._address)
            self.sent += 1
        except OSError as exc:
            log.warning("sd_notify failed", extra={"state": state, "error": str(exc)})

    def ready(self, status: str = "") -> None:
        self.notify("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def stopping(self) -> None:
        self.notify("STOPPING=1")

    async def watchdog_forever(self) -> None:
        if self._sock is None or self.watchdog_interval_s is None:
            return
        while True:
            self.notify("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_interval_s)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
