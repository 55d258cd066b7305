"""`gossipd demo`: the main job on the embedded default, start to finish.

Starts a real daemon process on the embedded default configuration (free loopback port), pushes
tasks through it as a producer would (one streamed, then a batch with a progress bar), prints
what happened, and stops the daemon with SIGTERM as systemd would.
"""

from __future__ import annotations

import sys

from gossipd.tools.client import Client
from gossipd.tools.launcher import DaemonProcess
from gossipd.tools.submit import _Line, numbered, print_report, submit_many


def run_demo(*, tasks: int) -> int:
    import uvloop

    daemon = DaemonProcess(name="demo")
    print(f"starting a daemon: {' '.join(daemon.command())}")
    daemon.start()
    print(f"daemon pid {daemon.pid} serving on {daemon.endpoint}; log in {daemon.log_path}")

    async def produce() -> bool:
        async with Client([daemon.endpoint]) as client:
            handle = await client.submit("the quick brown fox jumps", max_tokens=12, stream=True)
            sys.stdout.write("streamed: ")
            async for delta in handle.deltas():
                sys.stdout.write(delta)
                sys.stdout.flush()
            result = await handle.result()
            print(
                f"\n  -> ok={result.ok} node={result.node} chunks={result.chunks} "
                f"total {result.timings.total_ms:.2f} ms"
            )
        lines = [_Line(prompt=f"task {i} of the demo") for i in range(tasks)]
        report = await submit_many(
            [daemon.endpoint],
            numbered(lines),
            total=len(lines),
            resubmit_after_s=5.0,
            window=500,
            show_progress=True,
        )
        print_report(report, as_json=False)
        return result.ok and report.ok == report.total

    try:
        ok = uvloop.run(produce())
    finally:
        code = daemon.stop()
    print(f"daemon stopped by SIGTERM, exit status {code}")
    return 0 if ok and code == 0 else 1
