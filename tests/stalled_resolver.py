"""Run by tests/test_host_names.py inside a network and mount namespace of its own, whose
/etc/resolv.conf names a resolver on 127.0.0.1:53 that this script holds and never answers
(a resolver that stalls: what a producer can point its reply_to's host name at).

A daemon (echo engine) gets a task whose reply_to names such a host (or, with "seed", has
such a host as its gossip seed), then a task whose reply_to is an address.  Prints JSON: which answers came, and how long the second one's
took.  With libzmq looking the name up in the I/O thread every socket shares,
the second answer took about 20 s; looked up off that thread, it takes milliseconds."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.cluster import Cluster
from tests.helpers import RawProducer


def main(log_dir: str, mode: str) -> None:
    """``mode`` "reply": the first task's reply_to names the host; "seed": the daemon's
    gossip seed does (gossip sends to it from start-up on, and again every probe)."""
    resolver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    resolver.bind(("127.0.0.1", 53))  # held, never read: every query waits out its timeout
    seed = ['gossip.seeds=["tcp://stalled.example:5555"]'] if mode == "seed" else []
    cluster = Cluster(1, log_dir=log_dir, extra_overrides=seed)
    cluster.start()
    daemon = cluster.daemons[0]
    producer = RawProducer(daemon.endpoint)
    try:
        if mode == "reply":
            producer.send_task("to-a-name", reply_to="tcp://stalled.example:5555")
        time.sleep(0.3)  # (the name's lookup under way)
        sent = time.monotonic()
        producer.send_task("to-an-address")
        replies = producer.replies(until=lambda r: r, timeout_s=30)
        answered_after_s = time.monotonic() - sent
    finally:
        producer.close()
        cluster.stop()
        resolver.close()
    print(
        json.dumps(
            {
                "answered": [r.get("id") for r in replies],
                "answered_after_s": answered_after_s,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "reply")
