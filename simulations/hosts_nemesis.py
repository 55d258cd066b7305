"""The bed's nemesis: faults done to hosts and daemons, each measured from the daemons' views.

- ``partition``: the last host is cut off (its veth down) for ``cut_s``, then healed: how long
  each side took to see the other side not alive, and how long after the heal until every
  daemon sees every other alive again;
- ``kill``: every daemon of a host SIGKILLed; "systemd" (the bed's supervisor, per the unit's
  ``Restart=on-failure``) starts them again: the time until all are alive everywhere;
- ``pause``: one daemon SIGSTOPped for ``pause_s``, then SIGCONT;
- ``loss``: ``loss_percent`` % of a host's packets dropped both ways (nftables) for ``loss_s``;
  without ``nft`` the fault's entry says so (``unavailable``) and the report's ``loss``
  counts it: it is never skipped silently.
Each fault waits for the cluster to be whole again before the next (``settle``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from simulations.hosts_deploy import Deployment
from simulations.hosts_measure import Watcher, cut_detection, log_count
from simulations.hosts_net import Net, loss_available

FAULTS = ("partition", "kill", "pause", "loss")
RECOVERY_TIMEOUT_S = 60.0


@dataclass
class NemesisOptions:
    cut_s: float = 15.0
    pause_s: float = 5.0
    loss_s: float = 10.0
    loss_percent: int = 5
    settle_s: float = 2.0


def progress(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} hosts: {message}", file=sys.stderr, flush=True)


class Nemesis:
    def __init__(
        self, net: Net, deployment: Deployment, watcher: Watcher, opts: NemesisOptions
    ) -> None:
        self.net = net
        self.d = deployment
        self.watcher = watcher
        self.opts = opts

    @property
    def nodes(self) -> list[str]:
        return [u.name for u in self.d.units]

    def hold(self, seconds: float) -> None:
        """Wait, playing systemd meanwhile (restarts, notifications)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.d.supervise()
            time.sleep(0.05)

    def recovered_after(self, since: float) -> float:
        return round(self.watcher.wait_all_alive(self.nodes, RECOVERY_TIMEOUT_S, since=since), 2)

    def run(self, name: str) -> dict[str, Any]:
        faults: dict[str, Callable[[], dict[str, Any]]] = {
            "partition": self.partition,
            "kill": self.kill,
            "pause": self.pause,
            "loss": self.loss,
        }
        if name not in faults:
            raise ValueError(f"--nemesis: unknown fault {name!r} (choose from {', '.join(FAULTS)})")
        progress(f"fault {name}")
        result = {"fault": name, **faults[name]()}
        self.hold(self.opts.settle_s)
        return result

    def partition(self) -> dict[str, Any]:
        target = self.d.hosts[-1]
        rest = [u for hd in self.d.hosts if hd is not target for u in hd.units]
        etcd_errors_before = log_count(target.units, "etcd unreachable or refusing")
        t_cut_wall = time.time()  # the daemons' logs stamp wall-clock time
        self.net.cut(target.host)
        self.hold(self.opts.cut_s)
        seen = cut_detection(t_cut_wall, target.units, rest)
        etcd_errors = log_count(target.units, "etcd unreachable or refusing")
        t_heal = time.monotonic()
        self.net.heal(target.host)
        return {
            "host": target.node,
            "cut_s": self.opts.cut_s,
            "seen_by_both_sides_s": None
            if None in (seen["cut_side_s"], seen["other_side_s"])
            else max(seen["cut_side_s"], seen["other_side_s"]),
            **seen,
            "all_alive_after_heal_s": self.recovered_after(t_heal),
            "etcd_error_lines_on_cut_host": {
                n: etcd_errors[n] - etcd_errors_before.get(n, 0) for n in etcd_errors
            }
            if self.d.opts.etcd
            else None,
        }

    def kill(self) -> dict[str, Any]:
        target = self.d.hosts[1] if len(self.d.hosts) > 2 else self.d.hosts[-1]
        starts_before = sum(len(u.starts) for u in target.units)
        t_kill = time.monotonic()
        for unit in target.units:
            unit.kill()
        all_alive = self.recovered_after(t_kill)
        return {
            "host": target.node,
            "restarted_by_unit": sum(len(u.starts) for u in target.units) - starts_before,
            "all_alive_after_s": all_alive,
        }

    def pause(self) -> dict[str, Any]:
        unit = self.d.hosts[0].units[-1]
        t_pause = time.monotonic()
        unit.pause()
        self.hold(self.opts.pause_s)
        unit.resume()
        t_resume = time.monotonic()
        return {
            "daemon": unit.name,
            "pause_s": self.opts.pause_s,
            "all_alive_after_resume_s": self.recovered_after(t_resume),
            "since_pause_s": round(t_resume - t_pause, 2),
        }

    def loss(self) -> dict[str, Any]:
        target = self.d.hosts[-1]
        problem = loss_available()
        if problem is not None:
            progress(f"loss: {problem}")
            return {"host": target.node, "unavailable": problem}
        self.net.loss_on(target.host, self.opts.loss_percent)
        try:
            self.hold(self.opts.loss_s)
            dropped = self.net.loss_dropped(target.host)
        finally:
            self.net.loss_off(target.host)
        t_end = time.monotonic()
        return {
            "host": target.node,
            "percent": self.opts.loss_percent,
            "loss_s": self.opts.loss_s,
            "packets_dropped": dropped,
            "all_alive_after_s": self.recovered_after(t_end),
        }
