"""The whole-daemon simulator's parameters (``FanoutRun``) and the names its modules share:
fault kinds, the codes a producer retries, the event kinds of the world's heap."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gossipd.core.forwarder import Forwarder
from gossipd.core.lifecycle import TaskBook
from gossipd.core.messages import ErrorCode
from gossipd.core.owner import Owner

PRODUCER = "producer"
FAULT_KINDS = ("crash", "stall", "partition", "loss")
RETRYABLE = (ErrorCode.OVERLOADED, ErrorCode.SHUTTING_DOWN, ErrorCode.UNAVAILABLE)

# Event kinds (the heap holds (at, tie-break, seq, kind, node, payload)).
(
    SWIM_TICK,
    SWIM_MSG,
    PEER_MSG,
    FW_TICK,
    FINISH,
    TO_PRODUCER,
    ARRIVAL,
    RESUBMIT,
    FAULT,
    CANCEL,
    ABORTED,
    EXPIRE,
) = range(12)

# Who sends to a daemon's ingress (the source of a PEER_MSG below 0), and the producer key
# its connection gives what it sends, as the ingress stamps a CURVE key: the producer, and
# an intruder whose Cancels name the producer's tasks.
PRODUCER_SRC, INTRUDER_SRC = -1, -2
KEY_OF_SRC = {PRODUCER_SRC: "P" * 40, INTRUDER_SRC: "X" * 40}  # Z85 public keys


@dataclass
class FanoutRun:
    nodes: int = 16
    tasks: int = 20_000
    seed: int = 1
    faults: tuple[str, ...] = FAULT_KINDS
    fault_events: int = 0  # 0: about one of each kind per 10 simulated seconds
    load: float = 0.7  # offered load, a share of the cluster's engine capacity
    slots: int = 4  # engine requests each daemon runs at once
    service_s: float = 0.05  # mean engine time of a task
    # An aborted engine request (a Cancel, a Withdraw) holds its slot and its task's entry
    # this long before its worker ends, as a real engine's abort does: a copy of the task
    # that comes meanwhile meets the entry still stopping (core/lifecycle.py rule 3b);
    # 0: aborts are instant.
    abort_s: float = 0.005
    keys: int = 0  # distinct task keys (0: tasks / 20)
    stream_every: int = 10  # every n-th task streams chunks
    # Every n-th task is cancelled by its producer and by an intruder (another key: never
    # obeyed), as many others by the intruder alone, each a random time within 3 service
    # times of being sent; 0: none.
    cancel_every: int = 50
    latency_s: float = 0.0003  # median one-way latency
    loss: float = 0.05  # share of daemon-to-daemon messages lost during a loss fault
    timeout_ms: int = 30_000
    resubmit_s: float = 2.0  # a producer resends an id after this long without a Result
    producer_memory_s: float = 60.0
    restart_after_s: float = 3.0
    stall_s: float = 4.0
    fsync_s: float = 0.005  # journal records survive a crash once this old
    kill_loss_s: float = 0.001  # what a killed daemon sent this recently never leaves
    taskdone_delay_s: float = 0.0  # the owner's TaskDone leaves this long after its Result
    hedge: bool = False
    # Admission refuses (overloaded) a task whose expected queueing wait does not fit half its
    # remaining deadline, or queue_wait_target_s (core/queueing.py).
    queue_wait_admission: bool = True
    queue_wait_target_s: float = 0.0
    crash_at_s: float = -1.0  # scenario "degrade": crash crash_share of members at once then
    crash_share: float = 0.2
    check_every: int = 1000  # events between full consistency checks
    trace_task: str = ""  # record this task's events (replay of a violation)
    progress: Callable[[str], None] | None = None
    forwarder_class: type[Forwarder] = Forwarder
    # The owner's core (core/owner.py); a test swaps in a broken one to see the swarm catch it.
    owner_class: type[Owner] = Owner
    # The task book (core/lifecycle.py): a test swaps in one that obeys any key's Cancel.
    book_class: type[TaskBook] = TaskBook
    # The owner check (issue 17): an owner with this many tasks waiting for a slot takes its
    # engine as saturated and refuses Forwards asking if_free ("saturated"); 0: never.
    saturated_waiting: int = 0
    # An owner holds a forwarded task's Result while its forwarder is not alive in its view
    # and asks it by Confirm (core/heldresults.py, as fanout/holding.py does); False: sent
    # at once, as before (to measure what holding saves).
    hold_results: bool = True
    # fanout.confirm_results: "always" (every forwarded Result waits for its forwarder's
    # Confirm answer) or "suspect" (only while the forwarder is or was down in our view).
    confirm_results: str = "suspect"
