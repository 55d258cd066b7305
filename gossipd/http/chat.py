"""Chat messages to one prompt through the model's chat template (Jinja, as Hugging Face's
tokenizers and vLLM render it), in a sandbox: a template is data from the model directory.

Where the template comes from: ``chat_template.jinja`` in the model directory, else
``tokenizer_config.json``'s ``chat_template`` (a string, or the list form's "default" entry;
``gossipd model make-tiny`` writes one).  The echo engine, and a model without a template,
use ``PLAIN_TEMPLATE``.

The rendered prompt is the whole text the model reads: the model's own template writes the
special tokens it wants (``bos_token`` or none), and the door's chat task asks the engine to
add none (``params.add_special_tokens`` false), as vLLM's chat endpoint renders, then
tokenizes without them.  Removing a leading ``bos_token`` and letting the engine add one
instead gave the same tokens only where the template and the tokenizer agree on it.
``PLAIN_TEMPLATE`` writes none: a chat rendered through it is tokenized as a completion's
text is, with the tokenizer's own (``ChatTemplate.own``).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

log = logging.getLogger("gossipd.http.chat")

# Each message on its own lines, tagged with its role, then the assistant's turn.  With
# tools: first a system turn listing them; an assistant's calls in the Hermes form that the
# door reads back from answers (gossipd/http/tools.py).  Without tools, as before them.
PLAIN_TEMPLATE = (
    "{% if tools %}<|system|>\nTools you may call (a call: its name and arguments as JSON "
    "between tool_call tags):\n{% for t in tools %}{{ t['function'] | tojson }}\n{% endfor %}"
    "{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% if 'tool_calls' in m %}{% for c in m['tool_calls'] %}<tool_call>{{ {'name': "
    "c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>\n"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TemplateFailed(Exception):
    """The chat template could not render these messages (the request's fault: 400)."""


class TemplateBroken(Exception):
    """The model's chat template does not parse (the server's fault: 500 to each chat
    request; completions are still served)."""


def chat_template_for(model_dir: str) -> ChatTemplate:
    """The chat template of the model in ``model_dir`` ("" or none found: PLAIN_TEMPLATE),
    with the special tokens its tokenizer config names (read once)."""
    directory = Path(model_dir) if model_dir else None
    config: dict[str, object] = {}
    if directory is not None and (directory / "tokenizer_config.json").is_file():
        config = json.loads((directory / "tokenizer_config.json").read_text())
    template: object = None
    if directory is not None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    else:
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
    source = template if isinstance(template, str) else ""
    return ChatTemplate(
        source or PLAIN_TEMPLATE,
        bos_token=_token(config.get("bos_token")),
        eos_token=_token(config.get("eos_token")),
        own=bool(source),
    )


def _token(value: object) -> str:
    """A special token as tokenizer_config.json names it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class ChatTemplate:
    def __init__(
        self, source: str, *, bos_token: str = "", eos_token: str = "", own: bool = True
    ) -> None:
        # The model's own template, which writes the special tokens the model wants: its
        # chats' engine adds none.  PLAIN_TEMPLATE (no template in the model, or an engine
        # without a model directory) writes none: its chats are tokenized as a completion's
        # text is, with the tokenizer's BOS (`vllm serve` refuses a chat to such a model).
        self.own = own
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # As Hugging Face's apply_chat_template renders (templates rely on these): loop
        # controls, raise_exception, strftime_now, and its tojson (no HTML escapes).
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _generation_tag()],
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        self._template: Any = None
        self.broken = ""  # why the template does not parse; "" when it does
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            self.broken = (
                f"the model's chat template does not parse ({type(exc).__name__}: {exc}): "
                "/v1/chat/completions cannot be served until it is fixed (chat_template.jinja "
                "or tokenizer_config.json's chat_template); /v1/completions is"
            )
            log.error("chat template", extra={"problem": self.broken})
        self._special = {"bos_token": bos_token, "eos_token": eos_token}
        # What a template raises on messages it cannot render (jinja2 is imported only
        # when a door is built: the daemon without one never loads it).
        self._failures = (TemplateError, TypeError, ValueError, RecursionError)

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """``tools``: a chat's, as OpenAI sends them (None: none; a template may test "is
        not none", as Hugging Face and vLLM pass them)."""
        if self._template is None:
            raise TemplateBroken(self.broken)
        try:
            prompt = self._template.render(
                messages=messages,
                add_generation_prompt=True,
                tools=tools,
                documents=None,
                **self._special,
            )
        except self._failures as exc:
            raise TemplateFailed(f"{type(exc).__name__}: {exc}") from None
        return prompt


def _raise_exception(message: str) -> None:
    """A template's own refusal (``raise_exception("...")``): the client's 400 says it."""
    from jinja2 import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _generation_tag() -> Any:
    """``{% generation %}...{% endgeneration %}``, which Hugging Face's templates use to mark
    the assistant's tokens (TRL's assistant-only loss): rendered as its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> list[nodes.Node]:
            next(parser.stream)
            return list(parser.parse_statements(("name:endgeneration",), drop_needle=True))

    return GenerationTag
