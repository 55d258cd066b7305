"""Building and opening the HTTP door from a daemon's parts (kept out of daemon.py, which
only calls ``build_door`` and ``open_door``)."""

from __future__ import annotations

import ssl
from collections.abc import Callable

import zmq

from gossipd.clock import Clock
from gossipd.config import Config
from gossipd.core.codec import REPLY_FRAME_BYTES_MAX
from gossipd.http.chat import chat_template_for
from gossipd.http.door import DoorLinks, HttpDoor
from gossipd.http.keys import ApiKeys
from gossipd.http.server import serve
from gossipd.ingress.intake import Intake
from gossipd.looppull import LoopPullServer, loop_binds
from gossipd.replysender import ReplySender
from gossipd.zmtp import PeerCurve

PROMPT_ROOM_BYTES = 16 * 1024  # a task's fields beside its prompt: codec.TASK_FIXED_BYTES_MAX


def build_door(
    config: Config,
    *,
    intake: Intake,
    node: str,
    model: str,
    links: DoorLinks,
    producer_key: str,
    clock: Clock,
) -> HttpDoor:
    """The door over ``intake``; a prompt may take what a task frame may carry, less room
    for its other fields (at the ingress and between daemons)."""
    http = config.http
    model_dir = config.engine.model if config.engine.kind == "vllm" else ""
    return HttpDoor(
        http,
        intake=intake,
        node=node,
        model=model,
        chat=chat_template_for(model_dir),
        links=links,
        prompt_bytes_max=min(config.ingress.message_bytes_max, config.fanout.message_bytes_max)
        - PROMPT_ROOM_BYTES,
        keys=ApiKeys(http.keys_dir) if http.keys_dir else None,
        producer_key=producer_key,
        clock=clock,
    )


def reply_endpoint(config: Config) -> str:
    """Where the door's reply socket binds: http.reply_bind, else ingress.bind's host on
    any free port (preflight refuses a wildcard ingress host without reply_bind)."""
    if config.http.reply_bind:
        return config.http.reply_bind
    ingress = config.ingress.bind
    if ingress.startswith("ipc://"):
        return ingress + ".http-replies"
    return ingress.rpartition(":")[0] + ":*"


async def open_door(
    door: HttpDoor,
    config: Config,
    *,
    ctx: zmq.Context,
    replies: ReplySender,
    serve_curve: Callable[[zmq.Socket], None] | None,
    sender_allowed: Callable[[str], bool] | None = None,
    loop_curve: PeerCurve | None = None,
    on_read: Callable[[], None] | None = None,
) -> int:
    """Bind the reply socket and the HTTP listener; returns the HTTP port.  With CURVE,
    ``sender_allowed``: is a reply's sender (its frame's User-Id) still an authorised member?
    The reply socket is the loop's PULL (``loop_curve``: its CURVE) under
    http.reply_receiver "loop" where it binds the address, else libzmq's (``serve_curve``).
    ``on_read``: told of every read of the listener's and the loop reply socket's
    connections (busy-polling: gossipd/busypoll.py)."""
    endpoint = reply_endpoint(config)
    receiver = None
    if config.http.reply_receiver == "loop" and loop_binds(endpoint):
        receiver = LoopPullServer(
            message_bytes_max=REPLY_FRAME_BYTES_MAX,  # (as ZMQ_MAXMSGSIZE was)
            read_bytes_max=2 * REPLY_FRAME_BYTES_MAX,  # (128 MiB, not 16 such frames)
            curve=loop_curve,
            refused_lines_per_s=config.log.refused_lines_per_s,
            on_read=on_read,
        )
    door.answers.bind(ctx, endpoint, serve_curve, sender_allowed, receiver)
    # Tasks run here: no socket, and the runner's replies not even encoded.
    replies.deliver_locally(door.route, door.answers.deliver, door.answers.deliver_message)
    door.answers.start_receiving()
    host, _, port = config.http.bind.rpartition(":")
    context = None
    if config.http.tls_cert_file:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(config.http.tls_cert_file, config.http.tls_key_file)
    door.server = await serve(
        host.strip("[]"), int(port), door.handle, door.limits, tls=context, on_read=on_read
    )
    return door.server.sockets[0].getsockname()[1]
