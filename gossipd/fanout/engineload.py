"""The owner's own engine load as the owner check and its load records read it (issue 17).

Gossip's GPU state is sampled every ``gossip.meta_sample_s`` (1 s): too old for a check whose
point is to decide on the owner's current load.  ``EngineLoad.read`` asks the engine itself
(``Engine.stats``: vLLM's figures change with each scheduler step), at most once every
``every_s`` (5 ms), so a burst of Forwards costs one reading, not one each.
"""

from __future__ import annotations

from gossipd.clock import SYSTEM_CLOCK, Clock
from gossipd.engines.base import Engine, EngineStats


class EngineLoad:
    def __init__(self, engine: Engine, *, clock: Clock = SYSTEM_CLOCK, every_s: float = 0.005):
        self._engine = engine
        self._clock = clock
        self.every_s = every_s
        self._stats: EngineStats | None = None
        self._read_at = float("-inf")
        self.reads = 0

    def read(self) -> EngineStats:
        """The engine's figures, read at most ``every_s`` ago."""
        now = self._clock.monotonic()
        if self._stats is None or now - self._read_at >= self.every_s:
            self._stats = self._engine.stats()
            self._read_at = now
            self.reads += 1
        return self._stats
