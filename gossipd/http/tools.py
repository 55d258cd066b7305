"""Tool calling at the door: OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``
on a chat, the ``tool_calls`` of the answer, and the tool turns of the messages sent back.

As `vllm serve --enable-auto-tool-choice --tool-call-parser hermes` serves them:
- the tools go to the model's chat template (``tools``), which writes them into the prompt;
- ``tool_choice`` "required" holds the output to a JSON list of calls, a named function to
  that function's arguments (a structured output, run by the owner's engine); "auto" (the
  default with tools) lets the model write, and the door takes the calls it wrote in the
  Hermes form, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen, Hermes
  and most open models' templates), the text before the first as ``content``; "none" lets
  the model write and takes no call from it.
- an assistant message's ``tool_calls`` go to the template with their arguments as objects
  (what Hugging Face's templates expect; vLLM does the same), a tool message's
  ``tool_call_id`` as sent.

Pure functions, no IO: gossipd/http/openai_api.py decodes with them, openai_answers.py
answers with them.  docs/PROTOCOL.md "HTTP" documents every rule here.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import msgspec

_json_encode = msgspec.json.Encoder().encode

TOOLS_MAX = 128  # OpenAI's bound
NAME_CHARS_MAX = 256  # (OpenAI's names are 1-64 of [A-Za-z0-9_-]; vLLM takes any: MCP's "a:b")
CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
# A call between tags, or an unclosed last one up to the end (a model cut at max_tokens).
_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


class ToolError(ValueError):
    """A request's tools, tool_choice or tool turns break a rule: ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class ToolUse(msgspec.Struct, frozen=True, gc=False):
    """What a chat asks of its tools: ``tools`` as the template gets them, ``choice`` one of
    "none", "auto", "required", "named" (``name`` the function)."""

    tools: list[dict[str, Any]]
    choice: str
    name: str = ""
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """The answer's text is read for calls (its stream goes at its end)."""
        return self.choice != "none"


def decode_tools(doc: dict[str, Any]) -> ToolUse | None:
    """The chat body's tools and tool_choice; None where it gave no tools (then tool_choice
    may only ask none: "none", "auto", absent)."""
    tools = doc.get("tools")
    choice = doc.get("tool_choice")
    parallel = doc.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls: true or false", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice: there are no tools to choose from (tools)", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ToolError('tools: a list of {"type": "function", "function": {...}}', "tools")
    if len(tools) > TOOLS_MAX:
        raise ToolError(f"tools: at most {TOOLS_MAX}", "tools")
    taken = [_tool(i, tool) for i, tool in enumerate(tools)]
    names = {tool["function"]["name"] for tool in taken}
    if choice is None or choice in ("none", "auto", "required"):
        return ToolUse(taken, choice or "auto", parallel=parallel is not False)
    named = choice.get("function") if isinstance(choice, dict) else None
    name = named.get("name") if isinstance(named, dict) else None
    if (
        not isinstance(choice, dict)
        or choice.get("type", "function") != "function"  # (vLLM's default type)
        or not isinstance(name, str)
    ):
        raise ToolError(
            'tool_choice: "none", "auto", "required" or {"type": "function", "function": '
            '{"name": ...}}',
            "tool_choice",
        )
    if name not in names:
        raise ToolError(f"tool_choice: no tool named {name!r} in tools", "tool_choice")
    return ToolUse(taken, "named", name, parallel=parallel is not False)


def _tool(i: int, tool: object) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ToolError(f'{where}: {{"type": "function", "function": {{...}}}} (functions '
                        "only)", "tools")  # fmt: skip
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ToolError(f"{where}.function: an object with a name", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= NAME_CHARS_MAX:
        raise ToolError(f"{where}.function.name: a string of 1 to {NAME_CHARS_MAX} characters",
                        "tools")  # fmt: skip
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{where}.function.description: a string", "tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ToolError(f"{where}.function.parameters: a JSON Schema object", "tools")
    out: dict[str, Any] = {"name": name}
    if description is not None:
        out["description"] = description
    if parameters is not None:
        out["parameters"] = parameters
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolError(f"{where}.function.strict: true or false", "tools")
    if strict is not None:
        out["strict"] = strict
    return {"type": "function", "function": out}


def structured_for(use: ToolUse) -> dict[str, Any] | None:
    """The structured output that holds "required" and a named function's answers (a
    StructuredOutput's fields), as vLLM builds it; None for "none" and "auto"."""
    if use.choice == "named":
        for tool in use.tools:
            if tool["function"]["name"] == use.name:
                return {"json": _json_text(_parameters(tool))}
    if use.choice == "required":
        # Each tool's $defs go to the root, where its "$ref": "#/$defs/X" points (nested
        # pydantic models: openai.pydantic_function_tool, the Agents SDK), as vLLM does.
        defs: dict[str, Any] = {}
        items = []
        for tool in use.tools:
            parameters = dict(_parameters(tool))
            own = parameters.pop("$defs", {})
            if not isinstance(own, dict):
                raise ToolError(f"tools: $defs of {tool['function']['name']!r} must be an "
                                "object", "tools")  # fmt: skip
            for name, definition in own.items():
                if defs.setdefault(name, definition) != definition:
                    raise ToolError(f"tools: the definition {name!r} ($defs) differs between "
                                    "tools; one schema a name", "tools")  # fmt: skip
            items.append(
                {
                    "properties": {
                        "name": {"type": "string", "enum": [tool["function"]["name"]]},
                        "parameters": parameters,
                    },
                    "required": ["name", "parameters"],
                }
            )
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "anyOf": items},
        }
        if not use.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return {"json": _json_text(schema)}
    return None


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    # No parameters still holds the arguments to an object (vLLM's reading).
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _json_text(schema: dict[str, Any]) -> str:
    try:
        return _json_encode(schema).decode()
    except RecursionError:
        raise ToolError("tools: a parameters schema nested too deeply", "tools") from None


def tool_turn(i: int, message: dict[str, Any], rendered: dict[str, Any]) -> None:
    """An assistant message's ``tool_calls`` and a tool message's ``tool_call_id`` into
    ``rendered`` (the message as the template gets it)."""
    calls = message.get("tool_calls")
    if calls is not None and calls != []:
        if message["role"] != "assistant" or not isinstance(calls, list):
            raise ToolError(f"messages[{i}].tool_calls: a list, on an assistant message",
                            "messages")  # fmt: skip
        rendered["tool_calls"] = [_past_call(i, j, call) for j, call in enumerate(calls)]
    call_id = message.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise ToolError(f"messages[{i}].tool_call_id: a string", "messages")
        rendered["tool_call_id"] = call_id


def _past_call(i: int, j: int, call: object) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{j}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolError(f"{where}: {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                        "\"arguments\"}}", "messages")  # fmt: skip
    arguments = function.get("arguments")
    if isinstance(arguments, str):  # OpenAI's form: JSON text; templates expect the object
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            arguments = None
    # Not an object (a call cut at max_tokens, sent back): {} as vLLM reads it, so that the
    # conversation goes on.
    if not isinstance(arguments, dict):
        arguments = {}
    assert isinstance(call, dict)
    out: dict[str, Any] = {
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


class ToolAnswer(msgspec.Struct, frozen=True, gc=False):
    """A choice's text read for calls: ``content`` (None: none), the calls as OpenAI's
    answer carries them, and the finish reason that goes with them."""

    content: str | None
    calls: list[dict[str, Any]]
    finish_reason: str


def read_answer(use: ToolUse, text: str, finish_reason: str) -> ToolAnswer:
    """What the model wrote, as the answer to a chat with tools (``use.parses``)."""
    if use.choice == "named":
        if not text:  # (nothing written: no call, as vLLM answers it)
            return ToolAnswer(None, [], finish_reason)
        return ToolAnswer(None, [_call(use.name, text)], finish_reason)
    if use.choice == "required":
        calls = _required_calls(text)
        if calls is None:  # cut short (max_tokens) or not held: the text, as written
            return ToolAnswer(text, [], finish_reason)
        reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return ToolAnswer(None, calls, reason)
    found = hermes_calls(text)
    if found is None:
        return ToolAnswer(text, [], finish_reason)
    content, calls = found
    if not use.parallel:
        calls = calls[:1]  # (as vLLM keeps them)
    return ToolAnswer(content, calls, "tool_calls")


def content_part(held: str, delta: str, started: bool) -> tuple[str, str, bool]:
    """Streaming an "auto" answer: of the text ``held`` back so far and the next ``delta``,
    (what may go now as content, what to hold back, whether a call began); ``started``:
    some content went already.  Nothing from the first ``<tool_call>`` on goes before the
    answer is read; a tail that may begin one (``<tool``) waits for the next delta, and so
    does blank text at the start (blank before a call is no content).  What goes is always
    a prefix of the content the whole answer reads as (``read_answer``)."""
    text = held + delta
    start = text.find(CALL_START)
    if start >= 0:
        return (
            ("", "", True) if not started and not text[:start].strip() else (text[:start], "", True)
        )
    keep = 0
    for n in range(min(len(text), len(CALL_START) - 1), 0, -1):
        if text.endswith(CALL_START[:n]):
            keep = n
            break
    part = text[: len(text) - keep]
    if not started and not part.strip():
        return "", text, False
    return part, text[len(text) - keep :], False


def _required_calls(text: str) -> list[dict[str, Any]] | None:
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, list) or not doc:
        return None
    calls = []
    for item in doc:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        calls.append(_call(item["name"], _arguments_text(item.get("parameters", {}))))
    return calls


def hermes_calls(text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
    """The calls ``text`` writes in the Hermes form, and the text before the first (None
    when empty); None where it writes none, or one that is not a call's JSON (then the
    whole text is the answer, as vLLM's hermes parser reads it)."""
    if CALL_START not in text:
        return None
    calls = []
    for closed, open_end in _CALL_RE.findall(text):
        try:
            doc = json.loads(closed or open_end)
        except (ValueError, RecursionError):
            return None
        if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
            return None
        calls.append(_call(doc["name"], _arguments_text(doc.get("arguments", {}))))
    content = text[: text.find(CALL_START)]
    return (content if content.strip() else None), calls


def _arguments_text(arguments: object) -> str:
    return json.dumps(arguments, ensure_ascii=False)


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
