"""Faults, mixed into the world (simulations/fanout_world.py), and the journals a crash
replays.

Faults: crash (SIGKILL; the node restarts later and replays its journal), stall (SIGSTOP for
a while), partition (a few members cut off), loss (a share of daemon-to-daemon messages lost);
and the "degrade" scenario's mass crash.  A journal's records survive a crash once fsynced
(``fsync_s`` old)."""

from __future__ import annotations

import math

from gossipd.core.admission import Verdict
from gossipd.core.messages import Task
from simulations.fanout_daemon import SimDaemon
from simulations.fanout_run import FAULT, FAULT_KINDS


class Faults:
    """Injects the run's faults at random times and undoes them; keeps each daemon's journal."""

    def journal_accept(self, d: SimDaemon, task: Task, forwarder: str, received_at: float) -> None:
        # received_at: the deadline's base, kept by a restart (the daemon journals the deadline)
        self.journals[d.index][task.id] = (task, forwarder, self.now, received_at)
        self.journal_done_at[d.index].pop(task.id, None)

    def journal_done(self, d: SimDaemon, task_id: str) -> None:
        self.journal_done_at[d.index][task_id] = self.now

    def journal_replayed(self, d: SimDaemon, task: Task, verdict: Verdict | None, src: str) -> None:
        """What a restart's replay did with a journaled task (None: a member holds it)."""
        journal = self.journals[d.index]
        if verdict is None or verdict is not Verdict.ADMIT:
            journal.pop(task.id, None)
        elif src:
            _, _, _, received_at = journal[task.id]
            journal[task.id] = (task, src, self.now, received_at)  # still forwarded by src

    # -- faults ----------------------------------------------------------------------------------

    def schedule_faults(self, duration_s: float) -> None:
        run = self.run
        if run.crash_at_s >= 0:
            self.push(run.crash_at_s, FAULT, -1, ("mass_crash", 0))
        kinds = [k for k in run.faults if k in FAULT_KINDS]
        if not kinds:
            return
        count = run.fault_events or max(len(kinds), int(duration_s / 10.0) * len(kinds))
        for i in range(count):
            kind = kinds[i % len(kinds)]
            at = self.rng.uniform(0.1, 0.8) * duration_s
            self.push(at, FAULT, -1, (kind, self.rng.randrange(run.nodes)))

    def fault(self, payload: tuple[str, int]) -> None:
        kind, index = payload
        run = self.run
        if kind == "mass_crash":
            victims = self.rng.sample(range(run.nodes), int(run.nodes * run.crash_share))
            for v in victims:
                self.crash(v)
            self.fault_spans.append(("crash", (self.now, math.inf)))
            self.faults_log.append((self.now, f"crash {len(victims)} members"))
            return
        if kind == "crash" and not self.up[index] and sum(self.up) > 2:
            # Its target is down already (an earlier crash not restarted yet): another up
            # member instead, so that a run's N crashes are N members killed.
            index = self.rng.choice([i for i in range(run.nodes) if self.up[i]])
        if kind == "crash" and self.up[index] and sum(self.up) > 2:
            self.crash(index)
            self.push(self.now + run.restart_after_s, FAULT, -1, ("restart", index))
            self.fault_spans.append(("crash", (self.now, self.now + run.restart_after_s + 10)))
        elif kind == "restart":
            self.restart(index)
        elif kind == "stall" and self.up[index]:
            self.paused_until[index] = max(self.paused_until[index], self.now + run.stall_s)
            self.fault_spans.append(("stall", (self.now, self.now + run.stall_s)))
            self.active_faults["stall"] += 1
            self.push(self.now + run.stall_s, FAULT, -1, ("end_stall", index))
        elif kind == "end_stall":
            self.active_faults["stall"] -= 1
        elif kind == "partition" and run.nodes >= 4:
            cut = self.rng.sample(range(run.nodes), max(1, run.nodes // 8))
            for i in cut:
                self.cuts[i] += 1
                self.group[i] = 1
            # Its heal names it: an earlier partition's heal ends that one's cut only (the
            # first heal used to end every cut, an overlapping one early).
            self.partitions.append(cut)
            self.active_faults["partition"] += 1
            span = self.rng.uniform(1.0, 6.0)
            self.push(self.now + span, FAULT, -1, ("heal", len(self.partitions) - 1))
            self.fault_spans.append(("partition", (self.now, self.now + span)))
        elif kind == "heal":
            for i in self.partitions[index]:
                self.cuts[i] -= 1
                if not self.cuts[i]:
                    self.group[i] = 0
            self.active_faults["partition"] -= 1
        elif kind == "loss":
            self.loss = run.loss
            self.active_faults["loss"] += 1
            span = self.rng.uniform(1.0, 5.0)
            self.push(self.now + span, FAULT, -1, ("end_loss", 0))
            self.fault_spans.append(("loss", (self.now, self.now + span)))
        elif kind == "end_loss":
            self.active_faults["loss"] -= 1
            if not self.active_faults["loss"]:
                self.loss = 0.0
        else:
            return
        self.faults_log.append((self.now, f"{kind} d{index:04d}"))

    def faults_during(self, start: float, end: float) -> list[str]:
        """The kinds of fault under way at some point between ``start`` and ``end``."""
        kinds = {k for k, (a, b) in self.fault_spans if a <= end and b >= start}
        return sorted(kinds) or ["none"]

    def crash(self, index: int) -> None:
        d = self.daemons[index]
        self.up[index] = False
        self.crashed_at[(index, d.epoch)] = self.now
        self.active_faults["crash"] += 1
        for task_id in list(d.started_at):
            self.stopped_running(d, task_id)

    def restart(self, index: int) -> None:
        old = self.daemons[index]
        live = [self.swim_addrs[i] for i in range(self.run.nodes) if self.up[i] and i != index]
        seeds = self.rng.sample(live, min(3, len(live)))
        d = SimDaemon(self, index, old.epoch + 1, seeds)
        d.swim.set_gpu(self.now, d.gpu)  # a new process publishes its GPU state, as a daemon does
        self.daemons[index] = d
        self.up[index] = True
        self.paused_until[index] = 0.0
        self.active_faults["crash"] -= 1
        crashed = self.crashed_at[(index, old.epoch)]
        durable = crashed - self.run.fsync_s
        journal, done_at = self.journals[index], self.journal_done_at[index]
        # What reached the disk: accepts and dones fsynced before the crash.
        for task_id in list(journal):
            _, _, accepted_at, _ = journal[task_id]
            done = done_at.get(task_id)
            if accepted_at > durable:
                del journal[task_id]
            elif done is not None and done <= durable:
                del journal[task_id]
                del done_at[task_id]
        done_at.clear()
        # Each by its own deadline: forwarded ones at once (their forwarder's Withdraw drops
        # what it migrated; so does a member's answer that it holds one), the producers' own
        # once the live members were asked (ingress/replay.py, SimDaemon.replay_step).
        waiting, running = [], {}
        for task, src, _, received_at in list(journal.values()):
            if src:
                d.replay_one(task, src, received_at)
                if d.book.get(task.id) is not None:
                    running[task.id] = (task, src)
            else:
                waiting.append((task, src, received_at))
        d.begin_replay(waiting, running, expect_members=bool(seeds))
        self.schedule(d)
