"""`--help` describes every option of every subcommand: a walk over the argparse tree."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from gossipd.tools.cli import build_parser


def _walk(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            described = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                assert described.get(name), f"`{path} {name}`: the subcommand has no help"
                yield from _walk(sub, f"{path} {name}")
            continue
        yield path, action


def test_every_option_of_every_subcommand_has_help() -> None:
    missing = [
        f"{path} {'/'.join(action.option_strings) or action.dest}"
        for path, action in _walk(build_parser(), "gossipd")
        if not action.help or action.help == argparse.SUPPRESS
    ]
    assert not missing, f"options without --help text: {missing}"


def test_the_walk_sees_the_subcommands_and_their_options() -> None:
    seen = {(path, action.dest) for path, action in _walk(build_parser(), "gossipd")}
    assert ("gossipd submit", "out") in seen
    assert ("gossipd bench", "repeats") in seen
    assert ("gossipd model make-tiny", "seed") in seen
