"""The vLLM engine: an ``AsyncLLM`` in this process, its engine core in a child process.

Mapping to the daemon's engine interface:
- a task's sampling parameters become vLLM ``SamplingParams`` (``output_kind=DELTA``, so each
  output carries only the new text); values vLLM refuses raise ``InvalidRequest``
  (``bad_request``), as does a prompt too long for the model;
- cancelling the consuming task (deadline, producer cancel, shutdown) makes vLLM abort the
  request in its engine core (``AsyncLLM.generate`` does that on ``CancelledError``);
- a stat logger that vLLM calls once per engine step keeps the latest scheduler figures
  (running and waiting requests, KV-cache use, prefix-cache queries and hits) for gossip;
- engine death (the core process gone) raises ``EngineDead`` from running requests and turns
  ``healthy()`` False; the daemon then stops taking tasks and exits non-zero.

vLLM is imported only in ``start()``: a daemon with the echo engine never loads it.  vLLM 0.32
forks its engine core (spawn only once CUDA is initialised in this process, which the daemon
never does), so the core inherits what the daemon holds open: the journal lets go of its
file in a forked child (ingress/journal.py); the entry point must be import-safe anyway for
spawn (the ``gossipd`` console script is).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from gossipd.core.sampling import (
    LOGPROB_TOKEN_CHARS_MAX,
    MODEL_DEFAULT_MAX_TOKENS,
    MODEL_DEFAULT_TEMPERATURE,
    MODEL_DEFAULT_TOP_K,
    MODEL_DEFAULT_TOP_P,
    SamplingParams,
    TokenLogprob,
)
from gossipd.engines.base import (
    CONTEXT_EXCEEDED_PREFIX,
    LOGPROB_ENTRIES_MAX,
    EngineDead,
    EngineError,
    EngineNotRunning,
    EngineStats,
    GenerateRequest,
    InvalidRequest,
    check_prompt_logprobs,
    context_exceeded,
)
from gossipd.ops.logs import log_format, route_vllm_logs
from gossipd.ops.preflight import model_dir_problem

if TYPE_CHECKING:
    from gossipd.config import EngineConfig

log = logging.getLogger("gossipd.engine.vllm")
# vLLM's refusal of a prompt over the context (v1/engine/input_processor.py): its length
# and the model's, for an answer in OpenAI's words (base.context_exceeded).
_PROMPT_TOO_LONG = re.compile(
    r"prompt \(length (\d+)\)(?: plus the number of requested output tokens \(at least 1\))?"
    r" is longer than the maximum model length of (\d+)"
)


class _SchedulerFigures:
    """What the stat logger saw last (written from vLLM's output handler, read by gossip)."""

    __slots__ = (
        "kv_cache_usage",
        "prefix_hits",
        "prefix_queries",
        "running",
        "steps",
        "updated_at",
        "waiting",
    )

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache, in total
        self.prefix_hits = 0  # ...and found there
        self.updated_at = 0.0
        self.steps = 0  # the engine core's outputs read (one a step while it works)


def _stat_logger_factory(figures: _SchedulerFigures) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class GossipStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self._figures = figures

        def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kw: Any) -> None:
            f = self._figures
            f.steps += 1
            if scheduler_stats is None:
                return
            f.running = scheduler_stats.num_running_reqs
            f.waiting = scheduler_stats.num_waiting_reqs
            f.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            cache = scheduler_stats.prefix_cache_stats
            if cache is not None:
                f.prefix_queries += cache.queries
                f.prefix_hits += cache.hits
            f.updated_at = time.monotonic()

        def log_engine_initialized(self) -> None:
            return None

    return GossipStatLogger


# What a model's generation config may set (vLLM's get_diff_sampling_param) that a task
# carries: each value is taken as Task's params take it (sampling.SamplingParams' bounds).
_FROM_CONFIG = ("temperature", "top_p", "top_k", "max_tokens")


def sampling_defaults(diff: dict[str, Any]) -> tuple[dict[str, float | int], list[str]]:
    """A model's sampling defaults that tasks may take (temperature, top_p, top_k, top_k 0
    being off, -1; max_tokens, from max_new_tokens), and the names of those they cannot
    (repetition_penalty, min_p: Task.model_defaults has no bit for them, and a new bit would
    be refused by members before it; a value a task's params refuse)."""
    taken: dict[str, float | int] = {}
    unserved: list[str] = []
    for name, value in diff.items():
        if name == "top_k" and value == 0:
            value = -1
        if name in _FROM_CONFIG:
            try:
                taken[name] = getattr(msgspec.convert({name: value}, SamplingParams), name)
                continue
            except (msgspec.ValidationError, ValueError):
                pass
        unserved.append(name)
    return taken, sorted(unserved)


class VllmEngine:
    name = "vllm"

    def __init__(self, config: EngineConfig) -> None:
        if not config.model:
            raise ValueError("engine.model: required for the vllm engine (a model directory)")
        self._config = config
        self.model = config.served_model_name or Path(config.model).name
        self._llm: Any = None
        self._figures = _SchedulerFigures()
        self._tokens_total = 0
        self._dead = False
        self.block_size = 0  # tokens per KV-cache block, known after start()
        self.max_model_len = 0  # the longest prompt + output, known after start()
        # The model's own sampling defaults (generation_config.json), which the HTTP door
        # applies to what a request leaves out, as `vllm serve` does; known after start().
        self.sampling_defaults: dict[str, float | int] = {}

    async def start(self) -> None:
        c = self._config
        if (problem := model_dir_problem(c.model)) is not None:
            raise FileNotFoundError(problem)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a model directory needs no hub
        if c.cpu_kvcache_space_gb:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(c.cpu_kvcache_space_gb)
        if c.cpu_threads_bind:  # (read by its engine process, which inherits it)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = c.cpu_threads_bind
        # vLLM's own log records through our formatter, here and in its engine process.
        route_vllm_logs()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=c.model,
            served_model_name=self.model,
            dtype=c.dtype,
            max_model_len=c.max_model_len or None,
            generation_config=c.generation_config,
            gpu_memory_utilization=c.gpu_memory_utilization,
            tensor_parallel_size=c.tensor_parallel_size,
            enforce_eager=c.enforce_eager,
            enable_prefix_caching=c.enable_prefix_caching,
            num_gpu_blocks_override=c.kv_cache_blocks or None,
            max_num_seqs=c.max_num_seqs or None,
            seed=c.seed,
            use_tqdm_on_load=log_format() != "json",  # a progress bar is no JSON line
        )
        started = time.monotonic()
        # Blocks the loop while the engine core loads (tens of seconds on CPU); the daemon
        # starts its engine before it binds or serves anything, so nothing waits on the loop.
        self._llm = AsyncLLM.from_engine_args(
            args, stat_loggers=[_stat_logger_factory(self._figures)]
        )
        self.block_size = int(self._llm.vllm_config.cache_config.block_size or 0)
        self.max_model_len = int(self._llm.vllm_config.model_config.max_model_len or 0)
        self.sampling_defaults, unserved = sampling_defaults(
            self._llm.vllm_config.model_config.get_diff_sampling_param()
        )
        log.info(
            "vLLM engine started",
            extra={
                "model": c.model,
                "served_as": self.model,
                "seconds": round(time.monotonic() - started, 1),
                "kv_cache_blocks": self._llm.vllm_config.cache_config.num_gpu_blocks,
                "block_size": self.block_size,
                "sampling_defaults": self.sampling_defaults,
            },
        )
        if unserved:
            log.warning(
                "the model's generation config asks sampling that requests cannot leave to it "
                "(Task.model_defaults has no bit for it): not applied; a request may ask it",
                extra={"fields": unserved},
            )

    async def stop(self) -> None:
        if self._llm is not None:
            self._llm.shutdown(timeout=5.0)
            self._llm = None

    def sampling_params(self, request: GenerateRequest) -> Any:
        """vLLM's SamplingParams for a task; raises InvalidRequest for what vLLM refuses."""
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import (
            RequestOutputKind,
            SamplingParams,
            StructuredOutputsParams,
        )

        p = request.params
        max_tokens, temperature, top_p, top_k = p.max_tokens, p.temperature, p.top_p, p.top_k
        if request.model_defaults and self.sampling_defaults:
            asked, defaults = request.model_defaults, self.sampling_defaults
            if asked & MODEL_DEFAULT_TEMPERATURE and "temperature" in defaults:
                temperature = defaults["temperature"]
            if asked & MODEL_DEFAULT_TOP_P and "top_p" in defaults:
                top_p = defaults["top_p"]
            if asked & MODEL_DEFAULT_TOP_K and "top_k" in defaults:
                top_k = int(defaults["top_k"])
            if asked & MODEL_DEFAULT_MAX_TOKENS and "max_tokens" in defaults:
                max_tokens = min(max_tokens, int(defaults["max_tokens"]))
        try:
            structured = None
            if (form := p.structured) is not None:  # (exactly one is set: sampling.py)
                structured = StructuredOutputsParams(
                    json=form.json or None,
                    json_object=form.json_object or None,
                    regex=form.regex or None,
                    choice=list(form.choice) or None,
                    grammar=form.grammar or None,
                )
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=p.seed,
                stop=list(p.stop) or None,
                stop_token_ids=list(p.stop_token_ids) if p.stop_token_ids else None,
                logit_bias=dict(p.logit_bias) if p.logit_bias else None,
                ignore_eos=p.ignore_eos,
                presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty,
                repetition_penalty=p.repetition_penalty,
                min_p=p.min_p,
                min_tokens=p.min_tokens,
                structured_outputs=structured,
                logprobs=p.logprobs,
                prompt_logprobs=p.prompt_logprobs,
                output_kind=RequestOutputKind.DELTA,
            )
        except (VLLMClientError, ValueError, TypeError) as exc:
            raise _refused(exc, "sampling parameters refused by vLLM: ") from None

    def _check_prompt_logprobs(self, request: GenerateRequest, top: int) -> None:
        """Refuse a prompt whose scores a Result cannot carry before vLLM scores it: it
        scores the whole prompt, then builds every entry in this loop (a review: 2,000
        tokens with 20 top ones, 3 s of the engine and 0.8 s of the loop, then refused).
        The prompt's tokens: its ids; or at most a token a byte and a BOS, counted by the
        tokenizer (here: vLLM's renderer uses it on this loop too) only where that bound does
        not settle it."""
        if request.prompt_token_ids is not None:
            count = len(request.prompt_token_ids)
        else:
            count = len(request.prompt.encode()) + 1
            tokenizer = self._llm.tokenizer if self._llm is not None else None
            if count * (top + 1) > LOGPROB_ENTRIES_MAX and tokenizer is not None:
                bare = {} if request.params.add_special_tokens else {"add_special_tokens": False}
                count = len(tokenizer.encode(request.prompt, **bare))
        check_prompt_logprobs(count, top)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[str]:
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        if self._llm is None or not self.healthy():
            raise EngineNotRunning("the vLLM engine is not running")
        params = self.sampling_params(request)
        if params.prompt_logprobs is not None:
            self._check_prompt_logprobs(request, params.prompt_logprobs)
        try:
            usage = request.usage
            prompt: Any = request.prompt
            how: dict[str, Any] = {}  # (only what differs: the call as before otherwise)
            if request.prompt_token_ids is not None:  # (vLLM's TokensPrompt: a TypedDict)
                prompt = {"prompt_token_ids": request.prompt_token_ids}
            elif not request.params.add_special_tokens:  # a chat's: its template wrote them
                # (vLLM adds them to a text prompt otherwise; a dict of each call's own,
                # since vLLM's tokenize parameters take their keys out of what they get)
                how["tokenization_kwargs"] = {"add_special_tokens": False}
            async for output in self._llm.generate(prompt, params, request.request_id, **how):
                completion = output.outputs[0] if output.outputs else None
                if completion is None:
                    continue
                if output.prompt_token_ids is not None:
                    usage.prompt_tokens = len(output.prompt_token_ids)
                if request.prompt_logprobs is not None and output.prompt_logprobs:
                    # (In DELTA mode all of them come at once, at the end of the prefill.)
                    check_prompt_logprobs(len(output.prompt_logprobs), params.prompt_logprobs or 0)
                    request.prompt_logprobs.extend(
                        self._prompt_logprobs(
                            output.prompt_token_ids or (),
                            output.prompt_logprobs,
                            p_top=params.prompt_logprobs or 0,
                        )
                    )
                self._tokens_total += len(completion.token_ids)
                usage.completion_tokens += len(completion.token_ids)  # DELTA: this step's
                if request.logprobs is not None and completion.logprobs:
                    request.logprobs.extend(
                        _token_logprobs(completion.token_ids, completion.logprobs, params.logprobs)
                    )
                if completion.finish_reason is not None:
                    usage.finish_reason = str(completion.finish_reason)
                    if usage.finish_reason == "error":  # (vLLM's FINISHED_ERROR: its server
                        break  # answers 500; e.g. a grammar that rejected every token)
                # Byte-level tokens may end mid-character: vLLM holds those bytes back and
                # sends an empty delta, which is not worth a chunk.
                if completion.text:
                    yield completion.text
        except InvalidRequest:  # (ours: check_prompt_logprobs)
            raise
        except EngineDeadError as exc:
            self._dead = True
            raise EngineDead(f"the vLLM engine died: {exc}") from None
        except (VLLMClientError, ValueError) as exc:  # e.g. a prompt longer than the model
            too_long = _PROMPT_TOO_LONG.search(str(exc))
            if too_long is not None:
                prompt_len, max_len = int(too_long[1]), int(too_long[2])
                raise context_exceeded(max_len, prompt_len, str(exc)) from None
            raise _refused(exc) from None
        except Exception as exc:
            if not self.healthy():
                raise EngineDead(f"the vLLM engine died: {type(exc).__name__}") from None
            raise EngineError(f"{type(exc).__name__}: {exc}") from None
        if usage.finish_reason == "error":
            raise EngineError(
                "vLLM ended the request with an error (finish_reason error: for example a "
                "structured output's grammar that rejected every token)"
            )

    def _prompt_logprobs(self, token_ids: Any, steps: Any, p_top: int) -> list[TokenLogprob]:
        """vLLM's prompt logprobs as TokenLogprobs: the first position's is None (nothing
        comes before it), so its token's text is decoded here, logprob 0, no top ones."""
        out = _token_logprobs(token_ids[1:], steps[1:], p_top) if len(steps) > 1 else []
        if steps and steps[0] is None and token_ids:
            tokenizer = None if self._llm is None else self._llm.tokenizer
            first = tokenizer.decode([token_ids[0]]) if tokenizer is not None else ""
            out.insert(0, TokenLogprob(first[:LOGPROB_TOKEN_CHARS_MAX], 0.0, ()))
        return out

    def healthy(self) -> bool:
        if self._dead:
            return False
        if self._llm is not None and self._llm.errored:
            self._dead = True
            return False
        return True

    def unfinished_requests(self) -> int:
        """Requests the engine still holds (0 after every abort has landed)."""
        return 0 if self._llm is None else int(self._llm.get_num_unfinished_requests())

    def stats(self) -> EngineStats:
        f = self._figures
        return EngineStats(
            running_requests=f.running,
            waiting_requests=f.waiting,
            kv_cache_usage_ratio=f.kv_cache_usage,
            generated_tokens_total=self._tokens_total,
            queued_tokens=0 if self._llm is None else int(self._llm.get_num_queued_tokens()),
            unfinished_requests=self.unfinished_requests(),
            prefix_cache_queries_total=f.prefix_queries,
            prefix_cache_hits_total=f.prefix_hits,
            steps_total=f.steps,
        )

    def abandon(self, reason: str) -> None:
        """Hung: from now on not healthy, and its engine core processes are killed (SIGKILL
        ends a stopped process too), so that vLLM's own monitor sees them die and ends every
        request in them with EngineDeadError: the runner then hands those tasks on."""
        self._dead = True
        cores = self._core_pids()
        if not cores:
            log.warning("the hung vLLM engine has no core process to kill (in-process?)",
                        extra={"why": reason})  # fmt: skip
        # Its workers too (tensor parallelism: the GPU work is theirs, and one stuck in the
        # driver outlives its core, holding the GPU's memory): found before the cores die.
        doomed = [pid for core in cores for pid in _descendants(core)] + cores
        log.error("killing the hung vLLM engine core", extra={"pids": doomed, "why": reason})
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _core_pids(self) -> list[int]:
        """The engine core processes still running: vLLM's own list where this version has
        it, else our children that vLLM named (``VLLM::EngineCore``)."""
        manager = getattr(getattr(self._llm, "engine_core", None), "resources", None)
        processes = getattr(getattr(manager, "engine_manager", None), "processes", None)
        if processes:
            return [p.pid for p in processes if p.pid and p.is_alive()]
        return engine_cores_below(os.getpid())


def engine_cores_below(pid: int) -> list[int]:
    """The processes started by ``pid`` that vLLM named (``VLLM::EngineCore``; Linux: /proc)."""
    return [child for child in _children(pid) if _comm(child).startswith("VLLM")]


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for listed in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            out.extend(int(child) for child in listed.read_text().split())
    return out


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux: /proc), children before their parents' parents."""
    out: list[int] = []
    for child in _children(pid):
        out.extend(_descendants(child))
        out.append(child)
    return out


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text()
    except OSError:
        return ""


def _refused(exc: Exception, lead: str = "") -> InvalidRequest:
    """vLLM's refusal of a request as ours, led by the field it names (its
    VLLMValidationError's ``parameter``, e.g. "stop_token_ids: ..."): the door's 400 names
    that field (``openai_answers.error_of``)."""
    if str(exc).startswith(CONTEXT_EXCEEDED_PREFIX):  # (OpenAI's words, which clients
        return InvalidRequest(str(exc))  # match: the door answers context_length_exceeded)
    field = getattr(exc, "parameter", None)
    named = f"{field}: " if isinstance(field, str) and field else ""
    return InvalidRequest(f"{named}{lead}{exc}")


def _token_logprobs(token_ids: Any, steps: Any, top_n: int) -> list[TokenLogprob]:
    """vLLM's logprobs of a step's tokens (a dict a token: id -> Logprob, the sampled one
    and the ``top_n`` most likely) as TokenLogprobs: minus infinity as -9999, as its server."""
    out = []
    for token_id, step in zip(token_ids, steps, strict=False):
        chosen = step.get(token_id)
        ranked = sorted(step.values(), key=lambda lp: lp.rank)[:top_n]
        cut = LOGPROB_TOKEN_CHARS_MAX  # (what the wire carries of a token's text)
        out.append(
            TokenLogprob(
                (chosen.decoded_token or "")[:cut] if chosen is not None else "",
                max(chosen.logprob, -9999.0) if chosen is not None else -9999.0,
                tuple(((lp.decoded_token or "")[:cut], max(lp.logprob, -9999.0)) for lp in ranked),
            )
        )
    return out
