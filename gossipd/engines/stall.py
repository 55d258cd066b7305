"""When an engine is hung: it holds requests and has made no step for a while.

A stopped, deadlocked or wedged engine (its process SIGSTOPped, a GPU that stopped answering)
does not die: vLLM's own monitor watches its process's exit, and nothing else would end the
tasks in it before their deadlines.  The daemon's engine watch feeds this, every
``engine.health_interval_s``, the engine's unfinished requests and its step count
(``EngineStats``); once it says stalled, the engine is abandoned (its process killed) and the
daemon goes on as when the engine dies.
"""

from __future__ import annotations


class StallWatch:
    """``stalled`` once requests have waited ``timeout_s`` without a step (0: never).  An
    idle engine makes no steps and is never stalled: the time counts from the last look
    that saw it step or hold nothing.  A look that comes ``timeout_s`` / 2 or more after
    the one before starts the count again: the daemon's own loop was held up (a long
    pause, a frozen cgroup), and the engine's steps meanwhile may not have been read yet."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._steps = -1
        self._since = 0.0
        self._looked = float("-inf")

    def stalled(self, now: float, unfinished: int, steps: int) -> bool:
        if self.timeout_s <= 0:
            return False
        late = now - self._looked >= self.timeout_s / 2
        self._looked = now
        if unfinished == 0 or steps != self._steps or late:
            self._steps = steps
            self._since = now
            return False
        return now - self._since >= self.timeout_s

    def waited_s(self, now: float) -> float:
        """How long the engine has gone without a step while holding requests."""
        return now - self._since
