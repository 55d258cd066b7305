"""Member side of leader directives: handlers per ``kind`` for every directive this daemon's
fence admits (core/fencing.py: the highest token only, newest (token, seq) per kind), the
leader's own included.  A handler gets the Directive and its decoded msgpack body; a body that
does not decode is counted (``bad_body``) and not handed on; a handler that raises is logged
and the others still run."""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from gossipd.core.gossip_messages import Directive

log = logging.getLogger("gossipd.leader.directives")

Handler = Callable[[Directive, object], None]


class Directives:
    def __init__(self) -> None:
        self._handlers: dict[str, list[Handler]] = {}
        self.received: dict[str, int] = {}
        self.bad_body = 0
        self.handler_errors = 0

    def subscribe(self, kind: str, handler: Handler) -> None:
        self._handlers.setdefault(kind, []).append(handler)

    def deliver(self, directive: Directive) -> None:
        """An admitted directive (from the gossip shell)."""
        self.received[directive.kind] = self.received.get(directive.kind, 0) + 1
        handlers = self._handlers.get(directive.kind, [])
        if not handlers:
            return
        try:
            body = msgspec.msgpack.decode(directive.body) if directive.body else None
        except (msgspec.DecodeError, RecursionError):  # (nesting deeper than the stack)
            self.bad_body += 1
            log.warning(
                "directive %s from %s: body is not msgpack", directive.kind, directive.leader
            )
            return
        for handler in handlers:
            try:
                handler(directive, body)
            except Exception:
                self.handler_errors += 1
                log.exception("handler of directive %s failed", directive.kind)
