"""The fan-out promise under real faults: 4 daemons, 20,000 tasks, one daemon SIGKILLed (and
restarted) mid-run and another SIGTERMed; every task ends with exactly one final result, and
none of them is an error."""

from __future__ import annotations

from simulations.chaos import run_chaos


def test_no_accepted_task_is_lost_through_sigkill_and_sigterm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    report = run_chaos(nodes=4, tasks=20_000, log_dir=str(tmp_path), show=False)
    print(report)
    assert report["final_results"] == 20_000, "every task has one final result"
    assert report["lost"] == 0, "no task ended without a daemon's answer"
    # The fan-out promise: faults cost latency (migration, resubmission), never an error.
    assert report["client_visible_errors"] == 0, report["outcomes"]
    assert [name for _, name in report["faults"]] == ["SIGKILL d01", "SIGTERM d02", "restarted d01"]
