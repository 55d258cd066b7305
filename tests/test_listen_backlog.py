"""Every socket the daemon listens on queues a burst of connections in the kernel.

A listening socket's backlog bounds the connections the kernel has accepted for it and the
process has not taken yet; past it, a connection's SYN is dropped and its client waits for
TCP's first retransmission, 1 s later.  asyncio's ``create_server`` (uvloop's too) and libzmq
(ZMQ_BACKLOG) listen with 100 by default: 200 producers of one job connecting at once, or a
busy loop, and half of them started 1 s late (scripts/connect_storm.py found it: bench/README,
"Producers of one host connecting at once").  Here the process takes nothing while the
connections come (its loop busy, or the whole daemon SIGSTOPped): each must still be queued.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys

import pytest

from gossipd.looppull import LoopPullServer
from gossipd.ops.tcpdefaults import LISTEN_BACKLOG
from gossipd.tools.launcher import DaemonProcess

BURST = 300  # past the default 100, within LISTEN_BACKLOG


def _connect_burst(port: int, n: int) -> list[socket.socket]:
    """``n`` connections, each complete (the kernel's SYN-ACK) within 0.5 s, or raise: a
    dropped SYN is retried only after 1 s."""
    made: list[socket.socket] = []
    try:
        for i in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            made.append(sock)
            sock.settimeout(0.5)
            try:
                sock.connect(("127.0.0.1", port))
            except TimeoutError:
                raise AssertionError(
                    f"connection {i + 1} of {n} to port {port} not queued"
                ) from None
    except BaseException:
        for sock in made:
            sock.close()
        raise
    return made


def test_a_loop_server_whose_loop_is_busy_has_a_burst_of_connections_queued() -> None:
    assert LISTEN_BACKLOG >= BURST
    with open("/proc/sys/net/core/somaxconn") as f:  # the kernel caps every backlog at it
        assert int(f.read()) >= BURST, "raise net.core.somaxconn (128 before Linux 5.4)"

    async def main() -> int:
        server = LoopPullServer(message_bytes_max=1 << 20)
        port = int(server.bind("tcp://127.0.0.1:0").rsplit(":", 1)[1])
        server.receive(lambda frames, sender: None, lambda: None)
        await asyncio.sleep(0.05)  # serving (create_server listens again, with its backlog)
        made = _connect_burst(port, BURST)  # (blocking: the loop takes none meanwhile)
        for sock in made:
            sock.close()
        server.close()
        return len(made)

    assert asyncio.run(main()) == BURST


@pytest.mark.parametrize("receiver", ["loop", "zmq"])
def test_a_stopped_daemons_sockets_have_a_burst_of_connections_queued(receiver: str) -> None:
    """The ingress, the membership socket and the rpc channel, read by the loop or by
    libzmq (its context sets ZMQ_BACKLOG for every socket it makes)."""
    transport = "loop" if receiver == "loop" else "zmq"
    daemon = DaemonProcess(
        name=f"backlog-{receiver}",
        overrides=[
            f'ingress.receiver="{receiver}"',
            f'gossip.receiver="{receiver}"',
            f'fanout.peer_transport="{transport}"',
        ],
    ).start()
    try:
        daemon.signal(signal.SIGSTOP)  # takes no connection until SIGCONT
        try:
            for port in (daemon.port, daemon.gossip_port, daemon.rpc_port):
                for sock in _connect_burst(port, BURST):
                    sock.close()
        finally:
            daemon.signal(signal.SIGCONT)
    finally:
        assert daemon.stop() == 0


CLIENT = """
import asyncio
from gossipd.tools.client import Client
async def main():
    client = Client(["tcp://127.0.0.1:9"], reply_bind="tcp://127.0.0.1:0")
    client.open()
    print(client.reply_to, flush=True)
    await asyncio.sleep(60)
asyncio.run(main())
"""


def test_a_stopped_clients_reply_socket_has_a_burst_of_connections_queued() -> None:
    """Every daemon that answers a producer connects to its reply socket: a large cluster's
    at once must not wait 1 s each past libzmq's default."""
    proc = subprocess.Popen([sys.executable, "-c", CLIENT], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        reply_to = proc.stdout.readline().strip()
        assert reply_to.startswith("tcp://127.0.0.1:"), reply_to
        proc.send_signal(signal.SIGSTOP)
        try:
            for sock in _connect_burst(int(reply_to.rsplit(":", 1)[1]), BURST):
                sock.close()
        finally:
            proc.send_signal(signal.SIGCONT)
    finally:
        proc.kill()
        proc.wait()
