"""What one message costs the kernel on this machine: loopback TCP against a unix socket.

Two figures for each (300-byte messages, TCP_NODELAY on TCP):
- ``same_process_us``: one ``send`` and its ``recv`` in one process (no wake-up): the
  socket's own work in the kernel;
- ``rtt_us`` and ``cpu_us_per_rtt``: a ping-pong between two processes (a fork): the round
  trip's wall time and the CPU both processes spend on it, wake-ups included.

The peer channel between two daemons is the TCP case (bench/README, "Another machine, the
same code", where a trial of the unix case is reported).  Compare figures of one run with
each other: the machine is shared.

    python3 scripts/loopback_cost.py [--messages 20000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time

MESSAGE = b"x" * 300


def _pair(kind: str, where: str) -> tuple[socket.socket, socket.socket]:
    if kind == "tcp":
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            client = socket.create_connection(listener.getsockname())
            server, _ = listener.accept()
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return client, server
    path = os.path.join(where, "cost.sock")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen()
        client = socket.socket(socket.AF_UNIX)
        client.connect(path)
        server, _ = listener.accept()
    os.unlink(path)
    return client, server


def _cpu_s(times: os.times_result) -> float:
    return times.user + times.system + times.children_user + times.children_system


def measure(kind: str, messages: int, where: str) -> dict[str, float]:
    client, server = _pair(kind, where)
    t0 = time.process_time()
    for _ in range(messages):
        client.send(MESSAGE)
        server.recv(65536)
    same_process = (time.process_time() - t0) / messages * 1e6
    pid = os.fork()
    if pid == 0:  # the echoing side
        client.close()
        while data := server.recv(65536):
            server.send(data)
        os._exit(0)
    server.close()
    before, t0 = os.times(), time.perf_counter()
    for _ in range(messages):
        client.send(MESSAGE)
        client.recv(65536)
    rtt = (time.perf_counter() - t0) / messages * 1e6
    client.close()
    os.waitpid(pid, 0)  # its CPU counts in children_* once it is waited for
    cpu = (_cpu_s(os.times()) - _cpu_s(before)) / messages * 1e6
    return {
        "same_process_us": round(same_process, 2),
        "rtt_us": round(rtt, 1),
        "cpu_us_per_rtt": round(cpu, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as where:
        report = {kind: measure(kind, args.messages, where) for kind in ("tcp", "unix")}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for kind, r in report.items():
        print(
            f"{kind:>4}: send+recv in one process {r['same_process_us']:5.1f} us; "
            f"ping-pong {r['rtt_us']:6.1f} us a round trip, {r['cpu_us_per_rtt']:5.1f} us CPU"
        )


if __name__ == "__main__":
    main()
