"""The operator's acceptance test: docs/OPERATIONS.md's steps for a new node, run on the bed as
written, so that the test fails when the docs and the code part ways.

The section "Installing on an 8-GPU node (systemd)" is read as the operator reads it: every
line of its fenced code blocks, and its inline commands that start with
``/opt/gossipd/bin/gossipd`` or ``curl``, in document order, each under its step number.  A
TOML block is what the operator sets in the installed gossipd.toml ("and set what a real node
needs"): each of its keys replaces that key's line in its section (a key or section not there
is added).  Every command is either run on each bed host (``bash -c``, in the host's
namespaces with its paths: simulations/hosts_units.py) with the substitutions below, or is
one the bed stands in for, named in ``STAND_INS``; a command that matches neither fails the
test ("OPERATIONS.md has a command the bed does not know"), so a new step is noticed.

Substitutions (the bed's hosts are not the docs' node): the docs' node 10.0.0.5 is each host's
address, the other node 10.0.0.9 (``node9-gpu0``) is host h0 (whose own seeds are none: "none
on the first node"); 8 GPUs are the bed's G (``0-7``, ``{0..7}``, instance 3 is the last);
there is no ``gossipd`` user (step 2), so ``-g gossipd``/``chgrp gossipd`` name root's group;
``/root/gossipd-units`` and the ``/etc/`` that ``cp -r`` copies into are the host's own; render
reads the host's fake GPUs (``--sysfs``); the engine is echo (``kind = "vllm"`` and ``model``
are dropped); ``~`` is the host's root directory.  ``check-config`` runs once the keys exist
(the docs: "run it once the keys of step 5 exist").
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from simulations.hosts_deploy import REPO, HostDeploy

SECTION = "## Installing on an 8-GPU node (systemd)"
DOCS_GPUS = 8
INLINE_PREFIXES = ("/opt/gossipd/bin/gossipd ", "curl ")


class DocsDiverge(AssertionError):
    """OPERATIONS.md says something the bed cannot run, or a command it gives failed."""


@dataclass
class Command:
    step: int
    text: str  # one shell command line, as the docs write it (a TOML block: its text)
    toml: bool = False


def section(doc: str) -> str:
    start = doc.find(SECTION)
    if start < 0:
        raise DocsDiverge(f"docs/OPERATIONS.md has no section {SECTION!r}")
    end = doc.find("\n## ", start + len(SECTION))
    return doc[start : end if end > 0 else len(doc)]


def commands(doc: str) -> list[Command]:
    """The section's commands in order: fenced block lines, TOML blocks, inline commands (a
    code span may run over a line break of the Markdown source)."""
    out: list[Command] = []
    step = 0
    prose: list[str] = []

    def flush() -> None:
        for span in re.findall(r"`([^`]+)`", " ".join(" ".join(prose).split())):
            if span.startswith(INLINE_PREFIXES):
                out.append(Command(step, span))
        prose.clear()

    lines = section(doc).splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        numbered = re.match(r"^(\d+)\. \*\*", line)
        if numbered:
            flush()
            step = int(numbered.group(1))
        if line.strip().startswith("```"):
            flush()
            block = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith("```"):
                block.append(lines[i].strip())
                i += 1
            if block and block[0].startswith("["):
                out.append(Command(step, "\n".join(block), toml=True))
            else:
                for text in block:
                    text = re.sub(r"\s+#\s.*$", "", text).strip()  # the docs' own comments
                    if text and not text.startswith("#"):
                        out.append(Command(step, text))
        else:
            prose.append(line)
        i += 1
    flush()
    return out


# Commands the bed does not run, and what stands in for each (regex of the command line).
STAND_INS: list[tuple[str, str]] = [
    (r"^python3 -m venv /opt/gossipd-[\w.]+$", "the bed's own virtual environment"),
    (r"^/opt/gossipd-[\w.]+/bin/pip install ", "the bed's virtual environment has gossipd"),
    (
        r"^ln -sfn /opt/gossipd-[\w.]+ /opt/gossipd$",
        "/opt/gossipd is the bed's virtual environment (bind-mounted on the host)",
    ),
    (r"^systemctl daemon-reload$", "the bed reads the unit files afresh at every start"),
    (
        r"^systemctl enable --now gossipd\.target$",
        "the bed starts every gossipd@N as its unit says, on every host (hosts_units.Unit)",
    ),
]


@dataclass
class HostDocs:
    """The substitutions for one bed host."""

    hd: HostDeploy
    first: HostDeploy  # the docs' "another node" (10.0.0.9)
    gpus: int

    def substitute(self, text: str) -> str:
        last = self.gpus - 1
        root = self.hd.root
        text = text.replace("10.0.0.5", self.hd.host.addr)
        text = text.replace("10.0.0.9", self.first.host.addr)
        text = text.replace("node9-gpu0", f"{self.first.node}-gpu0")
        text = text.replace(f"0-{DOCS_GPUS - 1}", f"0-{last}")
        text = text.replace(f"{{0..{DOCS_GPUS - 1}}}", f"{{0..{last}}}")
        text = re.sub(r"-g gossipd\b", "-g root", text)
        text = re.sub(r"^chgrp gossipd\b", "chgrp root", text)
        text = text.replace("/root/gossipd-units", f"{root}/root/gossipd-units")
        text = re.sub(r"^(cp -r \S+) /etc/$", rf"\1 {root}/etc/", text)
        if " systemd render " in text:
            text += f" --sysfs {root}/sys"
        if " submit " in text:  # "a task through instance 3": the bed's last instance
            text = text.replace(":5587", f":{5557 + 10 * last}").replace("-gpu3", f"-gpu{last}")
        return text

    def toml_edits(self, block: str) -> list[tuple[str, str, str]]:
        """(section, key, line) for each key of a TOML block, as this host sets it."""
        edits, current = [], ""
        for raw in block.splitlines():
            line = self.substitute(raw)
            header = re.match(r"^\[([\w.]+)\]$", line)
            if header:
                current = header.group(1)
                continue
            key = line.split("=", 1)[0].strip()
            if (current, key) == ("engine", "model"):
                continue  # the echo engine has no model
            if (current, key) == ("engine", "kind"):
                line = 'kind = "echo"'
            if (current, key) == ("gossip", "seeds") and self.hd is self.first:
                line = "seeds = []  # the first node: none"
            edits.append((current, key, line))
        return edits


def edit_toml(path: Path, edits: list[tuple[str, str, str]]) -> None:
    """Set each key's line in its section of the file, as an operator edits it."""
    lines = path.read_text().splitlines()
    for sect, key, new in edits:
        start = next((i for i, ln in enumerate(lines) if ln.strip() == f"[{sect}]"), None)
        if start is None:
            lines += ["", f"[{sect}]", new]
            continue
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("[")), len(lines)
        )
        at = next(
            (i for i in range(start + 1, end) if re.match(rf"^{re.escape(key)}\s*=", lines[i])),
            None,
        )
        if at is None:
            lines.insert(start + 1, new)
        else:
            lines[at] = new
    path.write_text("\n".join(lines) + "\n")


def stand_in(text: str) -> str | None:
    for pattern, what in STAND_INS:
        if re.search(pattern, text):
            return what
    return None


RUNNABLE = (
    r"^/opt/gossipd/bin/gossipd ",
    r"^gossipd ",
    r"^install ",
    r"^chgrp ",
    r"^chmod ",
    r"^cp -r ",
    r"^curl ",
    r"^\(umask 0?[0-7]{3}; head -c \d+ /dev/urandom \| base64 > /etc/gossipd/[\w.]+\)$",
)


def plan(cmds: list[Command]) -> list[tuple[Command, str]]:
    """Each command with what the bed does: "run", "toml", "deferred" (check-config, once
    the keys exist) or the stand-in's text; DocsDiverge for a command the bed does not know."""
    out = []
    unknown = []
    for cmd in cmds:
        if cmd.toml:
            out.append((cmd, "toml"))
        elif (what := stand_in(cmd.text)) is not None:
            out.append((cmd, what))
        elif " check-config " in cmd.text:
            out.append((cmd, "deferred"))
        elif any(re.search(p, part.strip()) for p in RUNNABLE for part in cmd.text.split("&&")):
            out.append((cmd, "run"))
        else:
            unknown.append(cmd)
    if unknown:
        raise DocsDiverge(
            "docs/OPERATIONS.md has commands the bed does not know (run them in "
            "simulations/hosts_docs.py, or name what stands in for them): "
            + "; ".join(f"step {c.step}: {c.text!r}" for c in unknown)
        )
    return out


def bash(text: str) -> list[str]:
    return ["bash", "-c", f"set -eo pipefail; {text}"]


Runner = Callable[[HostDeploy, list[str]], tuple[int, str]]


def run_step(hd: HostDeploy, docs: HostDocs, cmd: Command, runner: Runner) -> str:
    """Run one documented command on ``hd``; its output; DocsDiverge if it failed."""
    text = docs.substitute(cmd.text)
    rc, out = runner(hd, bash(text))
    if rc != 0:
        raise DocsDiverge(
            f"OPERATIONS.md step {cmd.step} on {hd.node}: `{cmd.text}` "
            f"(as run: {shlex.quote(text)}) exited {rc}:\n{out[-2000:]}"
        )
    return out


def checkout_dir() -> Path:
    """Where the docs' relative paths (configs/local.toml) are: the checkout."""
    return REPO
