"""Chat messages to one prompt through the model's chat template (Jinja, as Hugging Face's
tokenizers and vLLM render it), in a sandbox: a template is data from the model directory.

Where the template comes from: ``chat_template.jinja`` in the model directory, else
``tokenizer_config.json``'s ``chat_template`` (a string, or the list form's "default" entry;
``gossipd model make-tiny`` writes one).  The echo engine, and a model without a template,
use ``PLAIN_TEMPLATE``.

The engine tokenizes the prompt with its special tokens (the BOS a model starts with), as
vLLM does for a completion; a template that writes ``bos_token`` itself would give two, so a
rendered prompt that starts with it loses that one (vLLM's chat endpoint renders, then
tokenizes without special tokens: the same tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

# Each message on its own lines, tagged with its role, then the assistant's turn.
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TemplateFailed(Exception):
    """The chat template could not render these messages (the request's fault: 400)."""


def find_template(model_dir: str) -> tuple[str, str]:
    """(template, where it came from) for the model in ``model_dir`` ("" for none)."""
    if model_dir:
        directory = Path(model_dir)
        jinja = directory / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(), str(jinja)
        config = directory / "tokenizer_config.json"
        if config.is_file():
            template = json.loads(config.read_text()).get("chat_template")
            if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                template = named.get("default")
            if isinstance(template, str) and template:
                return template, f"{config} (chat_template)"
    return PLAIN_TEMPLATE, "built in"


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(source)
        self._special = {"bos_token": bos_token, "eos_token": eos_token}
        self._bos = bos_token

    def render(self, messages: list[dict[str, str]]) -> str:
        from jinja2 import TemplateError

        try:
            prompt = self._template.render(
                messages=messages, add_generation_prompt=True, **self._special
            )
        except (TemplateError, TypeError, ValueError, RecursionError) as exc:
            raise TemplateFailed(f"{type(exc).__name__}: {exc}") from None
        if self._bos and prompt.startswith(self._bos):
            prompt = prompt[len(self._bos) :]  # the engine adds it
        return prompt
