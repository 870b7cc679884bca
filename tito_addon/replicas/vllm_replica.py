"""A faithful, GPU-less replica of vLLM's scale-out token-in/token-out chain.

What it serves (``shared/docs/wire-formats.md`` section 2, and the real bodies recorded from a
live vLLM 0.32.0 in ``shared/vllm_scale_out_examples/``):

* ``POST /v1/chat/completions/render``  -- ChatCompletionRequest in, ``GenerateRequest`` out
  (prompt ids from the tokenizer's stock chat template, sampling params resolved like vLLM,
  including the real "``max_tokens: 16`` is dropped" serialization bug);
* ``POST /inference/v1/generate``       -- generates from ``token_ids`` EXACTLY as given;
* ``POST /v1/chat/completions/derender`` -- decodes the completion ids and parses them like
  vLLM's ``qwen3`` reasoning parser and ``hermes`` tool parser;
* ``GET /version``, ``GET /health``, ``GET /v1/models``.

Two wire versions: ``0.32.0`` (matches the recorded bodies key for key) and ``0.24.0`` (the
first release with derender: no usage on generate, a random generate ``request_id``,
``"token_id:N"`` logprob placeholders, the 0.24 ``GenerateRequest`` field set).

The "model" is the scripted model both replicas serve (:mod:`tito_addon.replicas.scripted_model`): generate
has no messages, so it decodes the prompt ids, recovers the Qwen3 conversation from the text
(tools in the system block, tool results, assistant turns, ``enable_thinking=False`` from a
prompt that ends in an empty think block) and lets the same script decide the completion,
with the same deliberately non-canonical token splits.

Entry points: :class:`VllmReplica` (asyncio) and :class:`VllmReplicaThread` (own loop in a
background thread, for sync tests).  No torch, no GPU.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from tito_addon.replicas.faults import TRANSPORT_FAULTS, answer_transport_fault
from tito_addon.replicas.replica_runner import BackendThread, ServedApp, json_response
from tito_addon.replicas.replica_tokenizer import ReplicaTokenizer, load_tokenizer, noncanonical_ids
from tito_addon.replicas.scripted_model import (
    ASSISTANT_OPEN,
    THINK_END,
    THINK_START,
    TOOL_START,
    completion_text,
    conversation_from_prompt,
    logprob,
    script_turn,
)

__all__ = ["VLLM_FAULTS", "VllmReplica", "VllmReplicaConfig", "VllmReplicaThread"]

_RENDER = "/v1/chat/completions/render"
_GENERATE = "/inference/v1/generate"
_DERENDER = "/v1/chat/completions/derender"
_ENDPOINTS = {"render": _RENDER, "generate": _GENERATE, "derender": _DERENDER}

#: Fault kinds per endpoint (``"<endpoint>:<kind>"``); ``http<NNN>`` (any 4xx/5xx) works everywhere.
_COMMON_FAULTS = frozenset({"none"}) | TRANSPORT_FAULTS
VLLM_FAULTS: dict[str, frozenset[str]] = {
    "render": _COMMON_FAULTS,
    "generate": _COMMON_FAULTS
    | {"missing_ids", "empty_ids", "non_int_ids", "missing_logprobs", "logprobs_length", "short_prompt_ids"},
    "derender": _COMMON_FAULTS | {"not_chat", "empty_message"},
}
_HTTP_FAULT = re.compile(r"http([45]\d\d)")

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "TimeoutError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

#: vLLM's SamplingParams default ``max_tokens``; msgspec's omit_defaults drops a value equal to it.
_SAMPLING_DEFAULT_MAX_TOKENS = 16
_GREEDY_EPS = 1e-5
#: ChatParams defaults that 0.32's render reports in ``reasoning_parser_kwargs`` (recorded).
_CHAT_PARAM_DEFAULTS = {"cohere_format": "cmd4"}
_MAX_TOP_LOGPROBS = 20
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


# --------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------


class VllmReplicaConfig(BaseModel):
    """How the vLLM replica behaves.  Only ``tokenizer`` is required."""

    model_config = ConfigDict(extra="forbid")

    tokenizer: str = Field(description="HF tokenizer directory or hub name (Qwen3 chat format)")
    version: Literal["0.24.0", "0.32.0"] = "0.32.0"
    enable_scale_out: bool = Field(
        default=True,
        description="False: render/derender/generate answer 403 like vLLM >= 0.30 without --enable-scale-out "
        "(0.24 always registers them)",
    )
    tool_parser: bool = Field(default=True, description="--enable-auto-tool-choice --tool-call-parser hermes")
    reasoning_parser: bool = Field(default=True, description="--reasoning-parser qwen3")
    served_model_name: str = "tiny-qwen3"
    max_model_len: int = Field(default=4096, gt=1)
    noncanonical: bool = Field(default=True, description="emit deliberately non-canonical token splits")
    latency_s: float = Field(default=0.0, ge=0.0, description="sleep before answering each generate call")
    stream_delay_s: float = Field(default=0.0, ge=0.0, description="sleep between streamed generate events")
    answer_sentences: int = Field(
        default=0, ge=0, description="sentences (~14 tokens each) added to every answer: long completions (benchmarks)"
    )
    derender_delay_s: float = Field(
        default=0.0, ge=0.0, description="sleep before answering each streaming derender call (a busy server)"
    )
    weight_version: str = Field(
        default="default",
        description="0.32: the version in each generate choice's weight_versions span (a test may change it "
        "between requests, as a weight update would)",
    )
    previous_weight_version: str | None = Field(
        default=None,
        description="0.32: weights updated during every generation: the first half of its tokens report this "
        "version and the rest weight_version (two weight_versions spans)",
    )


class _HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def _bad(message: str, param: str | None = None) -> _HttpError:
    return _HttpError(400, message, param)


def _error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's ErrorResponse: ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError"),
            "param": param,
            "code": status,
        }
    }


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# --------------------------------------------------------------------------------------
# vLLM-side parsing (qwen3 reasoning parser + hermes tool parser, non-streaming)
# --------------------------------------------------------------------------------------


def parse_qwen3_reasoning(text: str, thinking_enabled: bool) -> tuple[str | None, str | None]:
    """vLLM ``Qwen3ReasoningParser.extract_reasoning`` (reasoning is NOT stripped)."""
    before, start, after = text.partition(THINK_START)
    text = after if start else before
    if THINK_END in text:
        reasoning, _, content = text.partition(THINK_END)
        return reasoning, content or None
    if not thinking_enabled:
        return None, text
    return text, None  # no </think>: truncated, everything is reasoning


def parse_hermes_tool_calls(text: str) -> tuple[list[tuple[str, str]], str | None]:
    """vLLM ``Hermes2ProToolParser.extract_tool_calls`` + the DelegatingParser post-step.

    Returns ``(calls, content)``; ``calls`` are ``(name, arguments JSON string)``.  Any
    malformed call (bad JSON, no name/arguments) means *no* tool calls and the whole text as
    content, like vLLM.
    """
    if TOOL_START not in text:
        return [], text
    try:
        calls: list[tuple[str, str]] = []
        for closed, open_ended in _TOOL_CALL_RE.findall(text):
            obj = json.loads(closed if closed else open_ended)
            calls.append((str(obj["name"]), json.dumps(obj["arguments"], ensure_ascii=False)))
    except (ValueError, KeyError, TypeError):
        return [], text
    content: str | None = text[: text.find(TOOL_START)] or None
    if content is not None and content.strip() == "":
        content = None
    return calls, content


def _token_text(tok: ReplicaTokenizer, tid: int, context: list[int]) -> str:
    """One token's text; a byte-fallback U+FFFD is repaired from up to 4 context tokens
    (vLLM ``_correct_decoded_token``)."""
    text = tok.token_texts([tid])[0]
    if not text.endswith("\ufffd"):
        return text
    for n in range(1, min(len(context), 4) + 1):
        ctx = context[-n:]
        full = tok.decode(ctx + [tid])
        if full.endswith("\ufffd"):
            continue
        clean_end = len(ctx)
        for j in range(len(ctx) - 1, -1, -1):
            if tok.token_texts([ctx[j]])[0].endswith("\ufffd"):
                clean_end = j
            else:
                break
        prefix = tok.decode(ctx[:clean_end]) if clean_end > 0 else ""
        if full.startswith(prefix):
            return full[len(prefix) :]
        common = 0
        for a, b in zip(prefix, full, strict=False):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""


# --------------------------------------------------------------------------------------
# the replica
# --------------------------------------------------------------------------------------


class VllmReplica(ServedApp):
    """The vLLM scale-out replica: an aiohttp app plus its state (received bodies, faults)."""

    def __init__(self, config: VllmReplicaConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer)
        #: ``(path, parsed body)`` of every POST to render / generate / derender, in order
        self.received: list[tuple[str, dict[str, Any]]] = []
        #: per successful generate: ``{"prompt_ids", "completion_ids", "logprobs"}``
        self.generated: list[dict[str, Any]] = []
        self.completed_streams = 0
        self.cancelled_streams = 0
        self._faults: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self.app = web.Application(client_max_size=256 * 1024 * 1024)
        self.app.router.add_get("/version", self._version)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_post(_RENDER, self._render)
        self.app.router.add_post(_GENERATE, self._generate)
        self.app.router.add_post(_DERENDER, self._derender)

    @property
    def v32(self) -> bool:
        return self.config.version == "0.32.0"

    def _random_id(self) -> str:
        """vLLM's ``random_uuid()``: 16 hex digits in 0.32, a full uuid4 hex in 0.24."""
        return uuid.uuid4().hex[:16] if self.v32 else uuid.uuid4().hex

    # ----------------------------------------------------------------- test controls
    def set_faults(self, faults: list[str]) -> None:
        """Replace the fault queue.  Each entry is ``"<render|generate|derender>:<kind>"``; the
        earliest queued fault for an endpoint is consumed by the next request to it."""
        parsed: list[tuple[str, str]] = []
        for f in faults:
            ep, _, kind = f.partition(":")
            if ep not in VLLM_FAULTS or not (kind in VLLM_FAULTS[ep] or _HTTP_FAULT.fullmatch(kind)):
                known = sorted(f"{e}:{k}" for e, ks in VLLM_FAULTS.items() for k in ks)
                raise ValueError(f"unknown fault {f!r}; known: {known} and '<endpoint>:http<4xx|5xx>'")
            parsed.append((ep, kind))
        with self._lock:
            self._faults = parsed

    def pending_faults(self) -> list[str]:
        with self._lock:
            return [f"{ep}:{kind}" for ep, kind in self._faults]

    def received_copy(self) -> list[tuple[str, dict[str, Any]]]:
        with self._lock:
            return list(self.received)

    def generated_copy(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.generated)

    def reset(self) -> None:
        """Forget received bodies, generations and pending faults."""
        with self._lock:
            self.received.clear()
            self.generated.clear()
            self.completed_streams = self.cancelled_streams = 0
            self._faults.clear()

    def _pop_fault(self, endpoint: str) -> str | None:
        with self._lock:
            for i, (ep, kind) in enumerate(self._faults):
                if ep == endpoint:
                    del self._faults[i]
                    return None if kind == "none" else kind
        return None

    # ----------------------------------------------------------------- small endpoints
    async def _version(self, request: web.Request) -> web.Response:
        return json_response({"version": self.config.version})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        name = self.config.served_model_name
        card = {
            "id": name,
            "object": "model",
            "created": now,
            "owned_by": "vllm",
            "root": self.config.tokenizer,
            "parent": None,
            "max_model_len": self.config.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{self._random_id()}",
                    "object": "model_permission",
                    "created": now,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        return json_response({"object": "list", "data": [card]})

    # ----------------------------------------------------------------- shared request plumbing
    async def _begin(
        self, request: web.Request, endpoint: str
    ) -> tuple[dict[str, Any] | None, web.StreamResponse | None, str | None]:
        """Read + record the body, apply gating and transport/status faults.

        Returns ``(body, None, body_fault)`` to continue, or ``(None, response, None)`` to answer
        right away.
        """
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            with self._lock:
                self.received.append((request.path, {"_raw": raw.decode("utf-8", "replace")}))
            return None, json_response(_error_body(400, f"Invalid JSON body: {exc}"), status=400), None
        with self._lock:
            self.received.append((request.path, body if isinstance(body, dict) else {"_raw": body}))
        if self.v32 and not self.config.enable_scale_out:
            msg = (
                f"{request.path} is a scale-out endpoint, which is disabled on this server. "
                "Start vLLM with --enable-scale-out to enable it."
            )
            return None, json_response(_error_body(403, msg), status=403), None
        fault = self._pop_fault(endpoint)
        if fault is not None:
            m = _HTTP_FAULT.fullmatch(fault)
            if m:
                code = int(m.group(1))
                body_ = _error_body(code, f"injected fault ({endpoint}:{fault})")
                return None, json_response(body_, status=code), None
            if fault in TRANSPORT_FAULTS:
                return None, await answer_transport_fault(request, fault, self._stopping), None
        if not isinstance(body, dict):
            return None, json_response(_error_body(400, "Request body must be a JSON object."), status=400), None
        return body, None, fault  # a remaining fault is a body fault, applied to the answer

    def _check_model(self, model: Any) -> None:
        if model is None:
            return
        if model != self.config.served_model_name:
            raise _HttpError(404, f"The model `{model}` does not exist.", param="model")

    # ----------------------------------------------------------------- render
    async def _render(self, request: web.Request) -> web.StreamResponse:
        body, early, fault = await self._begin(request, "render")
        if early is not None:
            return early
        assert body is not None
        try:
            out = self._render_body(body, request)
        except _HttpError as exc:
            return json_response(_error_body(exc.status, exc.message, exc.param), status=exc.status)
        return json_response(out)

    def _render_body(self, body: dict[str, Any], request: web.Request) -> dict[str, Any]:
        self._check_model(body.get("model"))
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise _bad("messages must be a non-empty list of message objects", param="messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise _bad("tools must be a list", param="tools")
        tool_choice = body.get("tool_choice")
        if tool_choice is None:
            tool_choice = "auto" if tools else "none"
        if tools and tool_choice == "auto" and not self.config.tool_parser:
            raise _bad('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        if body.get("use_beam_search"):
            raise _bad("Beam search is not supported by the render endpoint")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise _bad("chat_template_kwargs must be an object", param="chat_template_kwargs")
        add_generation_prompt = body.get("add_generation_prompt", True) is not False
        continue_final = body.get("continue_final_message") is True
        if add_generation_prompt and continue_final:
            raise _bad("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")

        prompt_ids = self._apply_template(messages, tools or None, kwargs, add_generation_prompt, continue_final)
        n_prompt = len(prompt_ids)
        room = self.config.max_model_len - n_prompt
        if room <= 0:
            raise _bad(
                f"This model's maximum context length is {self.config.max_model_len} tokens. However, your "
                f"request has {n_prompt} input tokens. Please reduce the length of the input messages."
            )
        requested = body.get("max_completion_tokens")
        if requested is None:
            requested = body.get("max_tokens")
        if requested is not None and (not _is_int(requested) or requested < 1):
            raise _bad("max_tokens must be at least 1", param="max_tokens")
        max_tokens = room if requested is None else min(requested, room)

        sampling = self._sampling_params(body, max_tokens, bool(tools) and tool_choice != "none")
        rid = request.headers.get("X-Request-Id") or (
            body["request_id"] if isinstance(body.get("request_id"), str) and body["request_id"] else self._random_id()
        )
        stream = body.get("stream") is True
        out: dict[str, Any] = {"request_id": f"chatcmpl-{rid}", "token_ids": prompt_ids}
        if self.v32:
            out.update({"token_offsets": None, "features": None, "content_parts": None})
        else:
            out["features"] = None
        out["sampling_params"] = sampling
        out["model"] = body.get("model")
        if self.v32:
            reasoning_ended: bool | None = None
            parser_kwargs: dict[str, Any] | None = None
            if self.config.reasoning_parser:
                reasoning_ended = self._reasoning_ended_in_prompt(prompt_ids)
                parser_kwargs = {
                    "chat_template_kwargs": {
                        **_CHAT_PARAM_DEFAULTS,
                        "add_generation_prompt": add_generation_prompt,
                        "continue_final_message": continue_final,
                        **kwargs,
                    }
                }
            out.update(
                {
                    "reasoning_ended": reasoning_ended,
                    "reasoning_parser_kwargs": parser_kwargs,
                    "return_token_ids": body.get("return_token_ids"),
                    "output_mode": "tokens",
                }
            )
        out["stream"] = stream
        out["stream_options"] = body.get("stream_options") if stream else None
        out["cache_salt"] = body.get("cache_salt")
        out["priority"] = body.get("priority") if _is_int(body.get("priority")) else 0
        out["kv_transfer_params"] = None
        if self.v32:
            out["ec_transfer_params"] = None
        return out

    def _apply_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[Any] | None,
        kwargs: dict[str, Any],
        add_generation_prompt: bool,
        continue_final: bool,
    ) -> list[int]:
        """vLLM's chat-message preprocessing, then the tokenizer's own chat template."""
        prepared: list[dict[str, Any]] = []
        for m in messages:
            m = dict(m)
            content = m.get("content")
            if isinstance(content, list):  # "string" content format: text parts joined by newlines
                m["content"] = "\n".join(
                    str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text"
                )
            if m.get("role") == "assistant":
                if m.get("reasoning") is not None and m.get("reasoning_content") is None:
                    m["reasoning_content"] = m["reasoning"]
                if isinstance(m.get("tool_calls"), list):
                    calls = []
                    for tc in m["tool_calls"]:
                        tc = json.loads(json.dumps(tc))
                        fn = tc.get("function") if isinstance(tc, dict) else None
                        if isinstance(fn, dict):
                            args = fn.get("arguments")
                            if not args:
                                fn["arguments"] = {}
                            elif isinstance(args, str):
                                try:
                                    fn["arguments"] = json.loads(args)
                                except json.JSONDecodeError as exc:
                                    raise _bad(f"tool call arguments are not valid JSON: {exc}") from exc
                        calls.append(tc)
                    m["tool_calls"] = calls
            prepared.append(m)
        extra = {
            k: v
            for k, v in kwargs.items()
            if k not in ("tools", "add_generation_prompt", "continue_final_message", "tokenize", "conversation")
        }
        tok = self.tokenizer
        try:
            with tok.lock:
                text = tok.tok.apply_chat_template(
                    prepared,
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final,
                    tokenize=False,
                    **extra,
                )
        except Exception as exc:  # jinja errors ("No user query found in messages.", ...)
            raise _bad(f"Failed to apply the chat template: {exc}") from exc
        if not isinstance(text, str):  # pragma: no cover - defensive
            raise _bad("the chat template did not render to a string")
        return tok.encode(text)

    def _reasoning_ended_in_prompt(self, prompt_ids: list[int]) -> bool:
        """Whether the CURRENT turn's think block is already closed (``enable_thinking=False``).

        History is ignored: a turn-2 prompt that carries turn 1's ``</think>`` is False, as recorded.
        """
        text = self.tokenizer.decode(prompt_ids)
        at = text.rfind(ASSISTANT_OPEN)
        return at != -1 and THINK_END in text[at + len(ASSISTANT_OPEN) :]

    def _sampling_params(self, body: dict[str, Any], max_tokens: int, tools_active: bool) -> dict[str, Any]:
        """``ChatCompletionRequest.to_sampling_params`` serialized the way the real server does.

        SamplingParams is a msgspec Struct with ``omit_defaults``: the recorded bodies show which
        keys survive (``top_p``/``min_p`` only when sampling, ``max_tokens`` unless it equals the
        default 16 -- the real bug --, ``logprobs`` only when not null, ...).
        """

        def num(key: str, default: float) -> float:
            v = body.get(key)
            return float(v) if _is_number(v) else default

        temperature = num("temperature", 1.0)
        greedy = temperature < _GREEDY_EPS
        sp: dict[str, Any] = {}
        n = body.get("n")
        if _is_int(n) and n != 1:
            sp["n"] = n
        sp["presence_penalty"] = num("presence_penalty", 0.0)
        sp["frequency_penalty"] = num("frequency_penalty", 0.0)
        sp["repetition_penalty"] = num("repetition_penalty", 1.0)
        sp["temperature"] = temperature
        if not greedy:
            sp["top_p"] = num("top_p", 1.0)
            top_k = body.get("top_k")
            if _is_int(top_k) and top_k not in (0, -1):
                sp["top_k"] = top_k
            sp["min_p"] = num("min_p", 0.0)
        if _is_int(body.get("seed")):
            sp["seed"] = body["seed"]
        stop = body.get("stop")
        sp["stop"] = [stop] if isinstance(stop, str) else [s for s in stop or [] if isinstance(s, str)]
        sp["stop_token_ids"] = [t for t in body.get("stop_token_ids") or [] if _is_int(t)]
        if body.get("ignore_eos") is True:
            sp["ignore_eos"] = True
        if max_tokens != _SAMPLING_DEFAULT_MAX_TOKENS:  # the real omit_defaults bug
            sp["max_tokens"] = max_tokens
        if _is_int(body.get("min_tokens")) and body["min_tokens"] > 0:
            sp["min_tokens"] = body["min_tokens"]
        if body.get("logprobs") is True:
            top = body.get("top_logprobs", 0)
            if top is not None:
                if not _is_int(top) or not (-1 <= top <= _MAX_TOP_LOGPROBS):
                    raise _bad("top_logprobs must be an integer between 0 and 20", param="top_logprobs")
                sp["logprobs"] = top
        if _is_int(body.get("prompt_logprobs")):
            sp["prompt_logprobs"] = body["prompt_logprobs"]
        skip_special = body.get("skip_special_tokens", True) is not False
        if tools_active and self.config.tool_parser:
            skip_special = False  # hermes adjust_request
        if not skip_special:
            sp["skip_special_tokens"] = False
        if body.get("spaces_between_special_tokens") is False:
            sp["spaces_between_special_tokens"] = False
        if body.get("include_stop_str_in_output") is True:
            sp["include_stop_str_in_output"] = True
        sp["output_kind"] = 2  # FINAL_ONLY
        sp["skip_clone"] = True
        sp["bad_words"] = [w for w in body.get("bad_words") or [] if isinstance(w, str)]
        sp["skip_reading_prefix_cache"] = False
        return sp

    # ----------------------------------------------------------------- generate
    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body, early, fault = await self._begin(request, "generate")
        if early is not None:
            return early
        assert body is not None
        try:
            gen = self._run_model(body, request)
        except _HttpError as exc:
            return json_response(_error_body(exc.status, exc.message, exc.param), status=exc.status)
        if self.config.latency_s > 0:
            await asyncio.sleep(self.config.latency_s)
        with self._lock:
            self.generated.append(
                {"prompt_ids": gen["prompt_ids"], "completion_ids": gen["ids"], "logprobs": gen["logprobs"]}
            )
        if self.v32 and body.get("stream") is True:
            return await self._stream_generate(request, body, gen, fault)
        return json_response(self._generate_body(body, gen, fault))

    def _run_model(self, body: dict[str, Any], request: web.Request) -> dict[str, Any]:
        tok = self.tokenizer
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids:
            raise _bad("token_ids: List should have at least 1 item after validation", param="token_ids")
        if not all(_is_int(t) for t in ids):
            raise _bad("token_ids: Input should be a valid integer", param="token_ids")
        if any(t < 0 for t in ids):
            raise _bad("token_ids must not contain negative values", param="token_ids")
        bad = next((t for t in ids if t >= tok.size), None)
        if bad is not None:
            raise _bad(f"Token id {bad} is out of vocabulary", param="token_ids")
        sp = body.get("sampling_params")
        if not isinstance(sp, dict):
            raise _bad("sampling_params: Field required", param="sampling_params")
        self._check_model(body.get("model"))
        if self.v32 and body.get("output_mode", "tokens") != "tokens":
            raise _bad("this replica only serves output_mode 'tokens'", param="output_mode")
        n_prompt = len(ids)
        room = self.config.max_model_len - n_prompt
        if room <= 0:
            raise _bad(
                f"This model's maximum context length is {self.config.max_model_len} tokens. However, your "
                f"request has {n_prompt} input tokens."
            )
        max_tokens = sp.get("max_tokens")  # absent -> server default: the rest of the context
        if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
            raise _bad(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
        limit = room if max_tokens is None else min(max_tokens, room)
        k = sp.get("logprobs")
        if k is not None and (not _is_int(k) or k < -1):
            raise _bad("logprobs must be a non-negative integer or -1", param="logprobs")

        prompt_ids = [int(t) for t in ids]
        conv, thinking = conversation_from_prompt(tok.decode(prompt_ids))
        script = script_turn(conv, thinking, answer_sentences=self.config.answer_sentences)
        text, spans, fallback = completion_text(script)
        out, _ = noncanonical_ids(tok, text, spans, fallback, enabled=self.config.noncanonical)
        out.append(tok.im_end)
        finish = "stop"
        if len(out) > limit:
            out, finish = out[:limit], "length"
        rid = request.headers.get("X-Request-Id") or (
            body["request_id"] if isinstance(body.get("request_id"), str) and body["request_id"] else self._random_id()
        )
        return {
            "request_id": f"generate-tokens-{rid}" if self.v32 else uuid.uuid4().hex,
            "prompt_ids": prompt_ids,
            "ids": out,
            "logprobs": [logprob(i, t) for i, t in enumerate(out)],
            "finish": finish,
            "top_k": None if k is None else (_MAX_TOP_LOGPROBS if k == -1 else min(k, _MAX_TOP_LOGPROBS)),
        }

    def _alternatives(self, tid: int, count: int) -> list[int]:
        first_added = self.tokenizer.first_added
        return [(tid + 7919 * j) % first_added for j in range(1, count + 1)]

    def _logprob_entry(self, gen: dict[str, Any], i: int, top_k: int) -> dict[str, Any]:
        """One position, in the version's shape; ``top_logprobs`` = the first ``top_k`` of
        (sampled, alternatives...), as recorded (``logprobs: 1`` lists only the sampled token)."""
        tid, lp = gen["ids"][i], gen["logprobs"][i]
        cands = [(tid, lp, 1)] + [
            (alt, round(lp - 1.5 * j, 6), j + 1) for j, alt in enumerate(self._alternatives(tid, top_k), start=1)
        ]
        cands = cands[: max(top_k, 0)]
        if self.v32:
            return {
                "token_id": tid,
                "logprob": lp,
                "rank": 1,
                "top_logprobs": [{"token_id": t, "logprob": v, "rank": r} for t, v, r in cands],
            }
        return {
            "token": f"token_id:{tid}",
            "logprob": lp,
            "bytes": None,
            "top_logprobs": [{"token": f"token_id:{t}", "logprob": v, "bytes": None} for t, v, _ in cands],
        }

    def _logprobs(self, gen: dict[str, Any], lo: int, hi: int, fault: str | None) -> dict[str, Any] | None:
        top_k = gen["top_k"]
        if fault == "missing_logprobs":
            return None
        if top_k is None and fault != "logprobs_length":
            return None
        entries = [self._logprob_entry(gen, i, top_k or 0) for i in range(lo, hi)]
        if fault == "logprobs_length" and hi == len(gen["ids"]) and entries:
            del entries[-1]
        return {"content": entries}

    @staticmethod
    def _echo(prompt_ids: list[int], fault: str | None) -> list[int]:
        """The prompt ids generate reports it ran on; ``short_prompt_ids``: one fewer than it was sent."""
        return list(prompt_ids[:-1] if fault == "short_prompt_ids" else prompt_ids)

    @staticmethod
    def _ids_with_fault(ids: list[int], fault: str | None) -> Any:
        if fault == "empty_ids":
            return []
        if fault == "non_int_ids":
            return [str(t) for t in ids]
        return list(ids)

    def _generate_body(self, body: dict[str, Any], gen: dict[str, Any], fault: str | None) -> dict[str, Any]:
        ids, n_prompt = gen["ids"], len(gen["prompt_ids"])
        logprobs = self._logprobs(gen, 0, len(ids), fault)
        if not self.v32:  # 0.24: only request_id (a fresh random id), choices, prompt_logprobs, kv_transfer_params
            choice: dict[str, Any] = {
                "index": 0,
                "logprobs": logprobs,
                "finish_reason": gen["finish"],
                "token_ids": self._ids_with_fault(ids, fault),
                "routed_experts": None,
            }
            if fault == "missing_ids":
                del choice["token_ids"]
            return {
                "request_id": gen["request_id"],
                "choices": [choice],
                "prompt_logprobs": None,
                "kv_transfer_params": None,
            }
        choice = {
            "index": 0,
            "finish_reason": gen["finish"],
            "stop_reason": None,
            "token_ids": self._ids_with_fault(ids, fault),
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": self._weight_versions(len(ids)),
            "logprobs": logprobs,
        }
        if fault == "missing_ids":
            del choice["token_ids"]
        return {
            "request_id": gen["request_id"],
            "model": body.get("model") or self.config.served_model_name,
            "created": int(time.time()),
            "usage": self._usage(n_prompt, len(ids)),
            "prompt_logprobs": None,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": self._echo(gen["prompt_ids"], fault) if body.get("return_token_ids") is True else None,
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "output_mode": "tokens",
            "choices": [choice],
        }

    def _weight_versions(self, n: int) -> list[dict[str, Any]]:
        """0.32's spans of the weights that sampled `n` output tokens."""
        now, before = self.config.weight_version, self.config.previous_weight_version
        if before is None or n < 2:
            return [{"version": now, "start": 0, "end": n}]
        return [{"version": before, "start": 0, "end": n // 2}, {"version": now, "start": n // 2, "end": n}]

    @staticmethod
    def _usage(prompt: int, completion: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }

    def _stream_events(self, body: dict[str, Any], gen: dict[str, Any], fault: str | None) -> Iterator[dict[str, Any]]:
        """0.32 SSE: one event per token; finish_reason/stop_reason/weight_versions on the last one."""
        ids = gen["ids"]
        n = len(ids)
        for i, tid in enumerate(ids):
            last = i == n - 1
            choice: dict[str, Any] = {
                "index": 0,
                "finish_reason": gen["finish"] if last else None,
                "stop_reason": None,
                "token_ids": self._ids_with_fault([tid], fault),
                "routed_experts": None,
                "sampling_mask": None,
                "weight_versions": self._weight_versions(n) if last else None,
                "logprobs": self._logprobs(gen, i, i + 1, fault),
            }
            if fault == "missing_ids":
                del choice["token_ids"]
            yield {
                "request_id": gen["request_id"],
                "usage": None,
                "prompt_token_ids": list(gen["prompt_ids"])
                if i == 0 and body.get("return_token_ids") is True
                else None,
                "mm_placeholders": None,
                "metrics": None,
                "output_mode": "tokens",
                "choices": [choice],
            }
        opts = body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage") is True:
            yield {
                "request_id": gen["request_id"],
                "usage": self._usage(len(gen["prompt_ids"]), n),
                "prompt_token_ids": None,
                "mm_placeholders": None,
                "metrics": None,
                "output_mode": "tokens",
                "choices": [],
            }

    async def _stream_generate(
        self, request: web.Request, body: dict[str, Any], gen: dict[str, Any], fault: str | None
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        try:
            for event in self._stream_events(body, gen, fault):
                await resp.write(f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode())
                if self.config.stream_delay_s:
                    await asyncio.sleep(self.config.stream_delay_s)
                if request.transport is None or request.transport.is_closing():
                    raise ConnectionResetError("client went away")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            # vLLM aborts a generation whose client disconnected; count it so tests can see the cancel.
            self.cancelled_streams += 1
            return resp
        self.completed_streams += 1
        return resp

    # ----------------------------------------------------------------- derender
    async def _derender(self, request: web.Request) -> web.StreamResponse:
        body, early, fault = await self._begin(request, "derender")
        if early is not None:
            return early
        assert body is not None
        if body.get("stream") is True and self.config.derender_delay_s > 0:
            await asyncio.sleep(self.config.derender_delay_s)
        try:
            out = self._derender_body(body)
        except _HttpError as exc:
            return json_response(_error_body(exc.status, exc.message, exc.param), status=exc.status)
        if fault == "not_chat":
            choice = out["choices"][0]
            out = {
                "id": out["id"],
                "object": "text_completion",
                "created": out["created"],
                "model": out["model"],
                "choices": [
                    {
                        "index": 0,
                        "text": choice["message"].get("content"),
                        "logprobs": None,
                        "finish_reason": choice["finish_reason"],
                    }
                ],
                "usage": out["usage"],
            }
        elif fault == "empty_message":
            msg = out["choices"][0]["message"]
            msg.update({"content": None, "reasoning": None})
            msg.pop("tool_calls", None)
        return json_response(out)

    def _derender_body(self, body: dict[str, Any]) -> dict[str, Any]:
        model = body.get("model")
        if model is None and not self.v32:
            raise _bad("model: Field required", param="model")
        self._check_model(model)
        if body.get("stream") is True:
            if not self.v32:
                raise _bad("streaming derender needs vLLM >= 0.27", param="stream")
            return self._derender_stream_chunk(body)
        gen = body.get("generate_response")
        if not isinstance(gen, dict) or not isinstance(gen.get("choices"), list):
            raise _bad("generate_response: Field required", param="generate_response")
        if self.v32 and gen.get("output_mode", "tokens") != "tokens":
            raise _bad(
                "generate_response must be an output_mode='tokens' response; text-mode responses are already "
                "detokenized",
                param="generate_response",
            )
        chat_request = body.get("chat_request")
        if chat_request is not None and not isinstance(chat_request, dict):
            raise _bad("chat_request must be a ChatCompletionRequest object", param="chat_request")
        has_parser = self.config.tool_parser or self.config.reasoning_parser
        if has_parser and chat_request is None:
            raise _bad(
                "chat_request is required when the server has a tool or reasoning parser configured",
                param="chat_request",
            )
        prompt_tokens = body.get("prompt_tokens")
        if prompt_tokens is None:
            prompt_tokens = 0
        if not _is_int(prompt_tokens) or prompt_tokens < 0:
            raise _bad("prompt_tokens must be a non-negative integer", param="prompt_tokens")

        tok = self.tokenizer
        choices: list[dict[str, Any]] = []
        completion_tokens = 0
        for ch in gen["choices"]:
            if not isinstance(ch, dict):
                raise _bad("generate_response.choices must hold objects", param="generate_response")
            ids = ch.get("token_ids")
            index = ch.get("index", 0)
            if not ids or not isinstance(ids, list):
                raise _bad(f"choice {index} has empty or null token_ids")
            if not all(_is_int(t) and 0 <= t < tok.size for t in ids):
                raise _bad(f"choice {index} has token ids outside the vocabulary")
            if len(ids) > self.config.max_model_len:
                raise _bad(
                    f"token_ids length ({len(ids)}) in choice {index} exceeds max_model_len "
                    f"({self.config.max_model_len})."
                )
            completion_tokens += len(ids)
            message = self._derender_message(ids, chat_request if has_parser else None, chat_request)
            choice: dict[str, Any] = {
                "index": index,
                "message": message,
                "logprobs": self._resolve_logprobs(ch.get("logprobs"), index),
                "finish_reason": ch.get("finish_reason"),  # verbatim: "stop" even with tool calls
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
            }
            choices.append(choice)

        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
        }
        out: dict[str, Any] = {
            "id": gen.get("request_id"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model or self.config.served_model_name,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage,
            "prompt_logprobs": gen.get("prompt_logprobs"),
            "prompt_token_ids": None,
        }
        if self.v32:
            usage["completion_tokens_details"] = None
            out["prompt_text"] = None
        out["kv_transfer_params"] = gen.get("kv_transfer_params")
        if self.v32:
            out["ec_transfer_params"] = None
            out["metrics"] = None
        return out

    def _derender_stream_chunk(self, body: dict[str, Any]) -> dict[str, Any]:
        """Streaming derender (0.31+ with parsers): one generate chunk in, one chat.completion.chunk out.

        Like vLLM, the state carries every output id so far; deltas are what the parsers newly produced. A
        tool call is sent whole once its block closes; the finish reason becomes "tool_calls" once any call
        was streamed (the 0.31-0.32 streaming parser path does this even after a length stop)."""
        chunk = body.get("generate_chunk")
        chat_request = body.get("chat_request")
        if not isinstance(chunk, dict) or not isinstance(chat_request, dict):
            raise _bad("generate_chunk and chat_request are required when streaming", param="generate_chunk")
        seed = body.get("prompt_token_ids")
        if (self.config.tool_parser or self.config.reasoning_parser) and not isinstance(seed, list):
            # Any list passes: the parsers scan it backwards for their tokens, the detokenizer reads its last ids.
            raise _bad("prompt_token_ids is required for streaming derender with a parser", param="prompt_token_ids")
        state = body.get("stream_state") or {"output_token_ids": [], "role_sent": False, "sent": {}, "tools": 0}
        choice = (chunk.get("choices") or [{}])[0]
        ids = list(state["output_token_ids"]) + list(choice.get("token_ids") or [])
        text = self.tokenizer.decode(ids)
        if not choice.get("finish_reason"):
            # vLLM's incremental detokenizer holds back a character whose UTF-8 bytes have not all arrived.
            text = text.rstrip("\ufffd")
        kwargs = chat_request.get("chat_template_kwargs") or {}
        thinking = not (isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False)
        reasoning, content = parse_qwen3_reasoning(text, thinking) if self.config.reasoning_parser else (None, text)
        content = content or ""
        calls: list[tuple[str, str]] = []
        if self.config.tool_parser and chat_request.get("tools") and TOOL_START in content:
            closed = content[: content.rfind("</tool_call>") + len("</tool_call>")] if "</tool_call>" in content else ""
            calls, _ = parse_hermes_tool_calls(closed) if closed else ([], None)
            content = content[: content.find(TOOL_START)]
        else:
            # Hold back a tail that may still become "<tool_call>".
            for cut in range(min(len(content), len(TOOL_START) - 1), 0, -1):
                if TOOL_START.startswith(content[-cut:]):
                    content = content[:-cut]
                    break
        sent = dict(state["sent"])
        delta: dict[str, Any] = {
            "role": None if state["role_sent"] else "assistant",
            "content": None,
            "reasoning": None,
        }
        for key, value in (("reasoning", reasoning or ""), ("content", content)):
            if len(value) > sent.get(key, 0):
                delta[key] = value[sent.get(key, 0) :]
                sent[key] = len(value)
        new_calls = calls[state["tools"] :]
        if new_calls:
            delta["tool_calls"] = [
                {"id": "chatcmpl-tool-" + self._random_id(), "type": "function", "index": state["tools"] + i,
                 "function": {"name": name, "arguments": args}}
                for i, (name, args) in enumerate(new_calls)
            ]  # fmt: skip
        tools = state["tools"] + len(new_calls)
        finish = choice.get("finish_reason")
        if finish and tools:
            finish = "tool_calls"
        out_chunk = {
            "id": chunk.get("request_id"), "object": "chat.completion.chunk", "created": int(time.time()),
            "model": body.get("model") or self.config.served_model_name,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                         "token_ids": None}],
            "usage": None, "system_fingerprint": None, "prompt_token_ids": None, "prompt_text": None, "metrics": None,
        }  # fmt: skip
        new_state = {"output_token_ids": ids, "role_sent": True, "sent": sent, "tools": tools}
        return {"chunk": out_chunk, "stream_state": new_state}

    def _derender_message(
        self, ids: list[int], parse_request: dict[str, Any] | None, chat_request: dict[str, Any] | None
    ) -> dict[str, Any]:
        tok = self.tokenizer
        reasoning: str | None = None
        calls: list[tuple[str, str]] = []
        if parse_request is not None:
            text = tok.decode(ids)  # skip_special_tokens=False: the parsers must see </think>, <tool_call>
            kwargs = parse_request.get("chat_template_kwargs") or {}
            thinking = not (isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False)
            content: str | None = text
            if self.config.reasoning_parser:
                reasoning, content = parse_qwen3_reasoning(text, thinking)
            tools = parse_request.get("tools")
            tool_choice = parse_request.get("tool_choice")
            if tool_choice is None:
                tool_choice = "auto" if tools else "none"
            if self.config.tool_parser and tool_choice != "none":
                calls, parsed = parse_hermes_tool_calls(content if content is not None else "")
                if calls:  # no calls: vLLM keeps the reasoning parser's content (None stays None)
                    content = parsed
            if parse_request.get("include_reasoning") is False:
                reasoning = None
        else:
            skip = not (isinstance(chat_request, dict) and chat_request.get("skip_special_tokens") is False)
            with tok.lock:
                content = str(tok.tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False))
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
        }
        tool_calls = [
            {"id": self._random_id(), "type": "function", "function": {"name": name, "arguments": args}}
            for name, args in calls
        ]
        if self.v32:
            if tool_calls:  # 0.32 drops an empty tool_calls list from the JSON
                message["tool_calls"] = tool_calls
        else:
            message["tool_calls"] = tool_calls
        message["reasoning"] = reasoning
        return message

    def _resolve_logprobs(self, logprobs: Any, index: Any) -> dict[str, Any] | None:
        """Generate logprobs (0.32 integer ids or 0.24 ``token_id:N`` strings) -> OpenAI chat
        logprobs with real token strings and bytes."""
        if logprobs is None:
            return None
        if not isinstance(logprobs, dict):
            raise _bad(f"choice {index} logprobs must be an object or null")
        content = logprobs.get("content")
        if content is None:
            return {"content": None}
        if not isinstance(content, list):
            raise _bad(f"choice {index} logprobs.content must be a list")
        if len(content) > self.config.max_model_len:
            raise _bad(f"logprobs.content length ({len(content)}) in choice {index} exceeds max_model_len.")
        context: list[int] = []

        def resolve(entry: Any) -> tuple[str, list[int] | None, int | None]:
            if not isinstance(entry, dict):
                raise _bad(f"choice {index} has a malformed logprob entry")
            tid = entry.get("token_id")
            token = entry.get("token")
            if tid is None and isinstance(token, str) and token.startswith("token_id:"):
                try:
                    tid = int(token[len("token_id:") :])
                except ValueError:
                    tid = None
            if _is_int(tid) and 0 <= tid < self.tokenizer.size:
                text = _token_text(self.tokenizer, tid, context)
                return text, list(text.encode("utf-8")), tid
            if isinstance(token, str):
                return token, entry.get("bytes"), None
            raise _bad(f"choice {index} has a logprob entry without token_id")

        out: list[dict[str, Any]] = []
        for entry in content:
            token, raw, tid = resolve(entry)
            tops = entry.get("top_logprobs") or []
            if len(tops) > _MAX_TOP_LOGPROBS:
                raise _bad(f"top_logprobs count ({len(tops)}) in choice {index} exceeds maximum (20).")
            top_out = []
            for t in tops:
                t_token, t_raw, _ = resolve(t)
                top_out.append({"token": t_token, "logprob": t.get("logprob", -9999.0), "bytes": t_raw})
            out.append(
                {"token": token, "logprob": entry.get("logprob", -9999.0), "bytes": raw, "top_logprobs": top_out}
            )
            if tid is not None:
                context.append(tid)
        return {"content": out}


# --------------------------------------------------------------------------------------
# background-thread helper for sync tests
# --------------------------------------------------------------------------------------


class VllmReplicaThread(BackendThread):
    """Run a :class:`VllmReplica` on its own event loop in a daemon thread.

    Same surface as :class:`~tito_addon.replicas.sglang_replica.ReplicaThread`: context manager,
    ``.url``, ``.backend``, ``.received()`` (``(path, body)`` tuples), ``.generated()``,
    ``.set_faults()``, ``.clear()``.
    """

    thread_name = "vllm-replica"
    backend: VllmReplica

    @staticmethod
    def _coerce_config(config: Any) -> VllmReplicaConfig:
        return config if isinstance(config, VllmReplicaConfig) else VllmReplicaConfig(tokenizer=str(config))

    def _make_backend(self, config: Any) -> VllmReplica:
        return VllmReplica(config)

    def received(self) -> list[tuple[str, dict[str, Any]]]:  # type: ignore[override]
        return self.backend.received_copy()
