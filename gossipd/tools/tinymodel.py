"""``gossipd model make-tiny DIR``: a small Llama with seeded random weights, made here.

Nothing in gossipd downloads a model.  Tests, benchmarks and the demo use this one: a byte-level
BPE tokenizer trained on a built-in corpus, and a 2-layer Llama (hidden 128, 2 heads of 64 --
vLLM's CPU attention rejects head_dim 16) saved in Hugging Face format.  Its output is gibberish,
but every part of the engine path is real, and the same directory loads in vLLM on a GPU.

The result depends only on ``seed``: the same seed writes the same weights and tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from gossipd.http.chat import PLAIN_TEMPLATE

# A corpus with the words our tests and benchmarks use, so that prompts tokenize compactly.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A peer-to-peer daemon gossips membership and GPU
state to its peers, elects a leader, and fans tasks out by consistent hashing with bounded loads.
You are a helpful assistant. Answer the question below in one short sentence, then stop.
Summarise the following document for an engineer who has five minutes to read it.
Translate the sentence into French, German and Spanish. Write a haiku about the sea.
hello world task prompt model engine cache prefix token stream result error deadline cancel
zero one two three four five six seven eight nine ten hundred thousand million
"""

TOKENIZER_VOCAB_SIZE = 512


# Chat requests render through it: the HTTP door's own plain template (gossipd/http/chat.py).
CHAT_TEMPLATE = PLAIN_TEMPLATE


def make_tiny(directory: str | Path, *, seed: int = 0, adds_bos: bool = False) -> Path:
    """Write the tokenizer and model into ``directory`` (created if needed); return its path.
    ``adds_bos``: the tokenizer adds ``<s>`` before a text tokenized with its special tokens,
    as Llama's do (the default one adds none; its chat template writes none either)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    if adds_bos:
        bos = ("<s>", tok.token_to_id("<s>"))
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[bos]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    # Chat requests (the HTTP door's /v1/chat/completions, `vllm serve`) render their
    # messages through it.
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    # Sampling defaults in its generation config, as released models ship them: `vllm
    # serve` and the HTTP door apply them to what a request leaves out.
    model.generation_config.do_sample = True
    model.generation_config.temperature = 0.8
    model.generation_config.top_p = 0.95
    model.save_pretrained(out, safe_serialization=True)
    (out / "gossipd-tiny.json").write_text(json.dumps({"seed": seed, "maker": "gossipd"}) + "\n")
    return out


# vLLM settings that serve the tiny model on a CPU machine (as configs/vllm-cpu.toml does):
# float32, a short context, a 1 GiB KV cache, no graph capture.
CPU_ENGINE_SETTINGS: dict[str, str | int | bool] = {
    "dtype": "float32",
    "max_model_len": 512,
    "cpu_kvcache_space_gb": 1,
    "enforce_eager": True,
}


def engine_overrides(model_dir: str | Path, **extra: str | int | bool) -> list[str]:
    """``--set`` items for a daemon serving ``model_dir`` with CPU_ENGINE_SETTINGS, plus
    ``extra`` engine keys (tests and benchmarks)."""
    settings = {**CPU_ENGINE_SETTINGS, **extra}
    return [
        "engine.kind=vllm",
        f"engine.model={json.dumps(str(model_dir))}",
        *(f"engine.{key}={_toml(value)}" for key, value in settings.items()),
    ]


def _toml(value: str | int | bool) -> str:
    return str(value).lower() if isinstance(value, bool) else json.dumps(value)
