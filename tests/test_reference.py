"""docs/CONFIG.md and docs/METRICS.md are what `gossipd reference` makes from the code: a key
or a metric added without regenerating them fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from gossipd.config import Config
from gossipd.core.swim_config import field_types
from gossipd.tools.reference import CONFIG_PATH, METRICS_PATH, render

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("what", "path"), [("config", CONFIG_PATH), ("metrics", METRICS_PATH)])
def test_the_committed_reference_is_up_to_date(what: str, path: str) -> None:
    committed = (ROOT / path).read_text() if (ROOT / path).exists() else ""
    assert committed == render(what), (
        f"{path} is stale: run `gossipd reference {what} --out {path}` and commit it"
    )


def test_the_config_reference_lists_every_key_with_its_default_and_bound() -> None:
    text = render("config")
    for section in Config.__struct_fields__:
        assert f"## `[{section}]`" in text
        for key in getattr(Config(), section).__struct_fields__:
            assert f"| `{key}` |" in text, f"{section}.{key} missing"
    for key in field_types():
        if key != "cluster":
            assert f"| `{key}` |" in text, f"gossip.swim.{key} missing"
    assert "| `pending_max` | int | 10_000 | >= 1 |" in text
    assert '| `preset` | "lan" \\| "local" \\| "wan" | "lan" |' in text  # sorted
    assert "| `queue_wait_deadline_ratio` | float | 0.5 | > 0.0, <= 1.0 |" in text


def test_the_metrics_reference_lists_every_family_with_type_labels_and_help() -> None:
    text = render("metrics")
    assert "| `gossipd_messages_received_total` | counter |  | always |" in text
    assert "| `gossipd_messages_refused_total` | counter | `reason` | always |" in text
    assert "| `gossipd_task_latency_seconds` | histogram |" in text
    assert "| `gossipd_members` | gauge | `state` | with membership" in text
    assert "| `gossipd_fanout_outstanding` | gauge | `member` | with membership" in text
