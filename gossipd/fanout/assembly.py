"""Membership and fan-out of one daemon, built in dependency order and wired: the placer,
the owner endpoint, gossip, the forwarder, load gossip, the dispatcher, the ResultHolder.

Out of the composition root (daemon.py), which passes in what it built before (the ingress,
the sockets, security, the journal) and keeps what this returns.  No part sets another's
attributes; the ingress is reached through its links (IngressLinks), connected here before
the first message is read.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import zmq

from gossipd import __version__
from gossipd.clock import Clock
from gossipd.config import Config
from gossipd.core.forwarder import Forwarder
from gossipd.core.gossip_messages import LoadRecord
from gossipd.core.heldresults import HeldResults
from gossipd.core.journeys import Refuse
from gossipd.core.loadstate import LoadSampler
from gossipd.core.messages import Drain
from gossipd.core.peer_messages import TaskDone
from gossipd.core.placer import Placer
from gossipd.core.ring import LoadCounts
from gossipd.engines.base import Engine
from gossipd.fanout.forwarding import Dispatcher
from gossipd.fanout.holding import ResultHolder
from gossipd.fanout.owner import OwnerEndpoint, zmq_peer_server
from gossipd.fanout.peerlinks import PeerLinks, zmq_peer_client
from gossipd.fanout.placement_feed import KernelLoader, PlacementFeed
from gossipd.http.clustermodels import ClusterModels
from gossipd.ingress.journal import Journal
from gossipd.ingress.links import IngressLinks
from gossipd.ingress.replay import JournalReplay
from gossipd.ingress.service import Ingress
from gossipd.looppeer import LoopPeerClient, LoopPeerServer
from gossipd.membership.gossip import GossipService
from gossipd.membership.loadgossip import LoadGossip
from gossipd.peerchannel import PeerClient, PeerServer
from gossipd.replysender import ReplySender
from gossipd.security import DOMAIN_PEERS, Security
from gossipd.sockets import SocketPool

# Our engine's own figures (the owner check, our load records) at most this old.
OWN_SAMPLE_EVERY_S = 0.005


@dataclass(frozen=True)
class Fanout:
    """What the daemon keeps of membership and fan-out."""

    gossip: GossipService
    dispatcher: Dispatcher
    load_gossip: LoadGossip
    holder: ResultHolder  # Results held for forwarders not alive
    rpc_endpoint: str  # where the owner endpoint is bound
    # Closes the peer connections whose member's key changed (or was unknown when they were
    # made): the peer channel's PeerClient.close_rekeyed.
    close_rekeyed: Callable[..., int]


def build_fanout(
    config: Config,
    *,
    node: str,
    ingress_endpoint: str,
    ctx: zmq.Context,
    sockets: SocketPool,
    engine: Engine,
    ingress: Ingress,
    links: IngressLinks,
    replies: ReplySender,
    security: Security,
    journal: Journal | None,
    replay: JournalReplay | None,
    cluster_models: ClusterModels,
    tracer: object,
    clock: Clock,
    rng: Callable[[str], random.Random],
    bind: Callable[[str, str, Callable[[], str]], str],
    refuse_forward: Callable[[Refuse], None],
    on_drain: Callable[[Drain], object],
    on_read: Callable[[], None] | None = None,
) -> Fanout:
    """``bind(key, endpoint, bind)``: binds the owner endpoint (a failure stops start-up);
    ``refuse_forward``: no member took a task from our intake; ``on_drain``: a Drain a
    member relayed to us (admin's, built after this); ``on_read``: told of every read of
    the loop's peer channel (busy-polling: gossipd/busypoll.py)."""
    # The cycles of calls left, closed before any message is read, by these names bound
    # below (tests/test_composition.py holds the list): the owner endpoint hands what peers
    # send us as a forwarder (TaskDones of tasks re-run from a journal, Confirms) to the
    # dispatcher, which is built on the owner endpoint; the owner endpoint and the
    # dispatcher hand Withdraws and ConfirmReplies of held Results to the holder, which asks
    # the endpoint who forwarded what and sends its Confirms through the dispatcher.
    dispatcher: Dispatcher
    holder: ResultHolder
    intake = ingress.intake
    # Our load on every ForwardReply and TaskDone (issue 17): in-flight counted live, the
    # engine's figures from its latest sample; seq from the wall clock (a restart orders on).
    own_load = LoadSampler(node, int(clock.wall() * 1000))

    # Per member: our forwards not yet done (bounded loads), counted by the forwarder;
    # the placer reads their sum as LoadCounts keeps it (no call back into the forwarder).
    loads = LoadCounts()
    local_ids: set[str] = set()  # our intake's tasks running here
    placer = Placer(
        config.fanout,
        node=node,
        loads=loads,
        local_ids=local_ids,
        weight=config.gpu.capacity_weight,
        model=intake.model,
        # Our own decisions, the owner check and our load records: the engine's own
        # figures, read at most every 5 ms (a burst of Forwards costs one reading).
        own_sample=engine.stats,
        own_sample_every_s=OWN_SAMPLE_EVERY_S,
        kernels=KernelLoader(),
    )

    def load_record() -> LoadRecord:
        now = clock.monotonic()
        stats = placer.own_now(now)  # the engine's own figures, at most 5 ms old
        assert stats is not None
        return own_load.current(
            now,
            inflight=intake.admission.pending,
            waiting=stats.waiting_requests,
            queued_tokens=stats.queued_tokens,
            kv_ratio=stats.kv_cache_usage_ratio,
        )

    def peer_replies(msgs: list[object], addr: str = "") -> None:
        dispatcher.on_peer_replies(msgs, addr)

    def send_to_member(member: str, msg: TaskDone) -> None:
        dispatcher.send_to_member(member, msg)

    # The peer channel (fanout.peer_transport): the loop's own ZMTP, or libzmq's sockets.
    peer_client: PeerClient
    peer_server: PeerServer
    if config.fanout.peer_transport == "loop":
        curve = security.loop_peer_curve()
        peer_client = LoopPeerClient(
            message_bytes_max=config.fanout.message_bytes_max,
            curve=curve,
            reconnect_max_s=config.fanout.peer_reconnect_max_s,
            clock=clock.monotonic,
            refused_lines_per_s=config.log.refused_lines_per_s,
            on_read=on_read,
        )
        peer_server = LoopPeerServer(
            message_bytes_max=config.fanout.message_bytes_max,
            curve=curve,
            refused_lines_per_s=config.log.refused_lines_per_s,
            on_read=on_read,
        )
    else:
        peer_client = zmq_peer_client(config.fanout, sockets, replies.names)
        peer_server = zmq_peer_server(
            config.fanout,
            ctx,
            serve_curve=(lambda sock: security.serve(sock, DOMAIN_PEERS))
            if security.curve
            else None,
        )
    owner = OwnerEndpoint(
        config.fanout,
        server=peer_server,
        node=node,
        ingress=ingress,
        send_to_member=send_to_member,
        on_peer_done=lambda msg: peer_replies([msg]),
        on_accepted=None
        if journal is None
        else (lambda task, src: journal.mark_forwarded(task.id, src)),
        clock=clock,
        task_bytes_max=config.ingress.message_bytes_max,  # as the ingress validates
        load_record=load_record,
        peer_allowed=security.peer_allowed if security.curve else None,
        saturated=placer.own_engine_saturated,
        on_withdraw_held=lambda task_id, member: holder.withdrawn(task_id, member),
        on_drain=on_drain,
        on_confirm=lambda msg: dispatcher.confirm(msg),
        replies=replies,
        # Under CURVE a member may only ask us to relay its own door's replies (routes
        # with its own key): else any member could draw another's replies to itself.
        relay_allowed=security.is_peers_key if security.curve else lambda src, key: True,
        model_card=cluster_models.card,
        replay_finished=lambda member, ids: dispatcher.finished_by(member, ids),
    )
    rpc_endpoint = bind("fanout.rpc_bind", config.fanout.rpc_bind, owner.bind)
    gossip = GossipService(
        config,
        node=node,
        sockets=sockets,
        engine=engine,
        ingress_endpoint=ingress_endpoint,
        rng=rng("membership"),
        version=__version__,
        security=security,
        clock=clock,
        rpc_endpoint=rpc_endpoint,
        model=intake.model,
        load=lambda: intake.admission.pending,
        prefixes=placer.prefix_summary,
        names=replies.names,  # (one resolver bound and cache for replies, gossip, peers)
    )
    PlacementFeed(placer, gossip)
    forwarder = Forwarder(
        Dispatcher.settings(
            config.fanout, config.ingress.retry_after_ms, config.ingress.retry_after_max_ms
        ),
        node=node,
        placement=placer,
        rng=rng("fanout"),
        loads=loads,
        local_ids=local_ids,
        boot=int(clock.wall() * 1000),
        relay_routes=replies.local_routes,  # the HTTP door's, once it opens
    )
    load_gossip = LoadGossip(
        gossip,
        view=placer.load_view,
        on_load=placer.on_load,
        own=load_record,
        rng=rng("load-gossip"),
        clock=clock,
    )
    dispatcher = Dispatcher(
        config.fanout,
        node=node,
        forwarder=forwarder,
        placer=placer,
        links=PeerLinks(
            config.fanout,
            channel=peer_client,
            on_reply=peer_replies,
        ),
        owner=owner,
        send_error=refuse_forward,
        admit_here=partial(intake.admit, answer=False),
        clock=clock,
        tracer=tracer,
        on_confirm_reply=lambda msg: holder.on_reply(msg),
        deliver_relayed=replies.deliver_here,
        on_model_card=cluster_models.on_card,
        on_replay_known=replay.on_known if replay else lambda msg, its_own: None,
        retry_after_here=lambda: intake.retry_after_ms,
        node_at=gossip.node_at,
    )
    # Subscriptions, and the ingress's links to fan-out (IngressLinks).
    gossip.listeners.append(dispatcher.member_event)
    gossip.listeners.append(owner.member_event)  # (a dead member's next boot starts afresh)
    links.router = dispatcher.route
    links.cancel_elsewhere = dispatcher.cancel_forwarded
    links.forwarded_for_other = forwarder.forwarded_for_other
    links.forwarded_here = forwarder.forwarded_here
    links.rescue = dispatcher.hand_off
    intake.on_admitted.append(placer.record_prefix)
    # Our load changes as tasks come and go: load gossip reads it at its next round.
    intake.on_admitted.append(load_gossip.poke)
    ingress.runner.on_finished.append(load_gossip.poke)
    ingress.runner.on_released.append(load_gossip.poke)
    ingress.runner.on_released.append(dispatcher.task_finished)
    intake.on_refused.append(dispatcher.task_finished)
    ingress.runner.on_finished.append(dispatcher.local_finished)
    ingress.runner.on_finished.append(owner.task_finished)
    holder = ResultHolder(
        HeldResults(
            bytes_max=config.fanout.held_results_bytes_max,
            always=config.fanout.confirm_results == "always",
        ),
        node=node,
        ingress=ingress,
        forwarders_of=owner.core.forwarders_of,
        member_alive=gossip.alive,
        member_of=gossip.member,
        send_confirm=dispatcher.send_to_member,
        clock=clock,
    )
    gossip.listeners.append(holder.member_event)
    links.hold = holder.hold
    links.answered_cached = holder.answered
    return Fanout(gossip, dispatcher, load_gossip, holder, rpc_endpoint, peer_client.close_rekeyed)
