"""ZeroMQ's I/O threads (and its reaper) under SCHED_BATCH (``node.zmq_io_batch``;
gossipd/config/node.py says why).

libzmq sets the policy as each I/O thread starts and aborts the whole process when the
kernel refuses it (a seccomp filter, a platform without the policy), so a throwaway thread
asks for it first: only what the kernel grants to a thread of this process is asked of libzmq.
"""

from __future__ import annotations

import os
import threading

import zmq


def _batch_allowed() -> bool:
    if not hasattr(os, "SCHED_BATCH"):
        return False
    if os.sched_getscheduler(0) in (os.SCHED_FIFO, os.SCHED_RR):
        # a real-time daemon: a libzmq that keeps the inherited priority would ask BATCH at
        # that priority, which the kernel refuses (and libzmq aborts); the probe asks at 0
        return False
    outcome: list[bool] = []

    def probe() -> None:
        try:  # 0: the calling thread (Linux sets the policy per thread)
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            outcome.append(True)
        except OSError:
            outcome.append(False)

    thread = threading.Thread(target=probe, name="sched-probe")
    thread.start()
    thread.join()
    return outcome == [True]


def batch_io_threads(ctx: zmq.Context) -> bool:
    """Have ``ctx`` start its I/O threads under SCHED_BATCH; False (and the default policy)
    when this process may not use it.  Call before the context's first socket."""
    if not _batch_allowed():
        return False
    ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
    return True
