"""What the intake and the runner call in parts built after them (fan-out, admin)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gossipd.core.lifecycle import Owned
from gossipd.core.messages import Drain, Result, StatusQuery, Task


@dataclass(slots=True)
class IngressLinks:
    """What the ingress calls in parts built after it, which need the ingress themselves (a
    cycle a constructor cannot close): the composition root (daemon.py) connects each once,
    before the first message is read.  Unconnected, every task runs here and an admin
    request is refused.

    - ``router(task, now)``: True if another member owns the task (the dispatcher forwards it);
    - ``rescue(task, received_at)``: gives a task whose engine died to another member (True
      if one took it);
    - ``cancel_elsewhere(task_id, producer_key)``: passes a Cancel on to the member running a
      forwarded task: "forwarded", "refused" (another key's task) or None (not known);
    - ``cancel_waiting(task_id, producer_key)``: cancels a task a restart read from the
      journal and has not admitted yet (it asks the members first, ingress/replay.py):
      "here", "refused" or None;
    - ``forwarded_for_other(task)``: True if a task with its id that another key submitted
      is being forwarded from here, or ran elsewhere and is not reported done;
    - ``forwarded_here(task)``: True if a task with its id and key is being forwarded from
      here, or ran elsewhere and is not reported done (a resend: not charged again);
    - ``hold(owned, result, size)``: True when a forwarded task's final Result is held back
      (its forwarder is not alive in our view, fanout/holding.py); it is sent later by
      ``end_held``, or never when the forwarder migrated the task;
    - ``answered_cached(task_id)``: a resubmission was answered from the results cache;
    - ``admin(request, now, producer_key)``: answers an operator's StatusQuery or Drain
      (gossipd/admin.py), with CURVE over a connection to the asking producer's key.
    """

    router: Callable[[Task, float], bool] | None = None
    rescue: Callable[[Task, float], Awaitable[bool]] | None = None
    cancel_elsewhere: Callable[[str, str], str | None] | None = None
    cancel_waiting: Callable[[str, str], str | None] | None = None
    forwarded_for_other: Callable[[Task], bool] | None = None
    forwarded_here: Callable[[Task], bool] | None = None
    admin: Callable[[StatusQuery | Drain, float, str], None] | None = None
    hold: Callable[[Owned, Result, int], bool] | None = None
    answered_cached: Callable[[str], None] | None = None
