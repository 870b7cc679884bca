"""vLLM (>= 0.24): token-exact turns through the scale-out chain render -> generate -> derender.

vLLM's own chat endpoint silently ignores unknown fields, so an `input_ids` there would be dropped and the
messages re-tokenized. Instead:

1. `/v1/chat/completions/render` resolves the sampling params server-side; its from-scratch `token_ids` are
   only compared with ours (the per-turn drift signal, `render_skew`).
2. `/inference/v1/generate` runs on our exact prompt ids and returns the exact completion ids + logprobs.
3. `/v1/chat/completions/derender` turns those ids into the chat completion the agent receives, with the
   server's tool and reasoning parsers (they read `tools`/`tool_choice` from `chat_request`).

What the server speaks is read from `GET /version` once per backend, never guessed: 0.30+ is asked to echo
the prompt ids it ran on (checked against ours), 0.32+ gets `prompt_token_ids` on derender; both logprob
shapes (0.24-0.31 `"token_id:N"` strings, 0.32+ integer `token_id`) are read and cross-checked. 0.32+ generate
choices (streamed: the final chunk) carry `weight_versions` spans, recorded as the turn's weight version.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tito_addon.backends.backend_protocol import (
    BackendResult,
    BackendTurn,
    StreamEnd,
    checked_ids,
    checked_logprobs,
    checked_message,
    stream_end,
    trajectory_message,
    weight_spans_of,
)
from tito_addon.backends.chunk_batches import batches, due, merged_generate_chunk
from tito_addon.backends.engine_failover import FailoverLog
from tito_addon.backends.expert_routes import without_choice_routes
from tito_addon.backends.image_features import placed_features
from tito_addon.backends.parser_inputs import derender_chat_request, prompt_seed
from tito_addon.backends.resumed_generation import (
    DEFAULT_RESUME,
    ResumePolicy,
    ResumeStats,
    recorded_spans,
)
from tito_addon.backends.server_facts import ServerFacts, ask_served_models
from tito_addon.backends.stream_accumulator import MessageAccumulator, clean_delta_chunk
from tito_addon.backends.upstream_client import UpstreamClient, UpstreamResponse
from tito_addon.backends.vllm_generation import VllmGeneration, checked_stream_choice, harvest_generate
from tito_addon.canonical_chat import ChatRequest
from tito_addon.tito_errors import BadRequest, TitoError, UpstreamMalformed, UpstreamPassthrough, UpstreamUnavailable

logger = logging.getLogger(__name__)

RENDER_PATH = "/v1/chat/completions/render"
DERENDER_PATH = "/v1/chat/completions/derender"
# vLLM's SamplingParams default: render leaves a requested max_tokens of exactly 16 out of sampling_params,
# and generate then runs to the context limit.
RENDER_DROPPED_MAX_TOKENS = 16


class ScaleOutDisabled(TitoError):
    status = 502
    error_type = "vllm_scale_out_disabled"


@dataclass(frozen=True)
class VllmVersion:
    text: str | None
    major_minor: tuple[int, int] | None

    def at_least(self, major: int, minor: int) -> bool:
        return self.major_minor is not None and self.major_minor >= (major, minor)


def parse_version(text: str | None) -> VllmVersion:
    match = re.match(r"^\s*v?(\d+)\.(\d+)", text or "")
    return VllmVersion(text, (int(match.group(1)), int(match.group(2))) if match else None)


def render_skew(render_ids: Any, prompt_ids: list[int]) -> dict[str, Any] | None:
    """Does vLLM's from-scratch render equal our ids? None when render returned no usable ids."""
    if not isinstance(render_ids, list) or not all(type(i) is int for i in render_ids):
        return None
    if render_ids == prompt_ids:
        return {"equal": True, "first_divergence": None}
    first = next((i for i, (a, b) in enumerate(zip(render_ids, prompt_ids, strict=False)) if a != b), None)
    return {"equal": False, "first_divergence": min(len(render_ids), len(prompt_ids)) if first is None else first}


class VllmBackend:
    kind = "vllm"

    def __init__(
        self,
        client: UpstreamClient,
        *,
        merge_stream_chunks: bool = False,
        compact_requests: bool = False,
        resume: ResumePolicy = DEFAULT_RESUME,
        resume_stats: ResumeStats | None = None,
    ) -> None:
        self.client = client
        self.generation = VllmGeneration(client, self._call, resume, resume_stats or ResumeStats())
        # Kept also where the server did not say (then only the 0.24 wire features are used).
        self.versions = ServerFacts(self._ask_version)
        self.models = ServerFacts(functools.partial(ask_served_models, client))
        # Derender the generate chunks that arrived during a streaming derender call as one (parsers that give
        # the same message however the output is chunked); else one call per chunk.
        self.merge_stream_chunks = merge_stream_chunks
        # Send derender a seed of the prompt and no messages (`parser_inputs`): parsers known to read no more.
        self.compact_requests = compact_requests

    def check_request(self, request: ChatRequest) -> None:
        if not request.model:
            raise BadRequest("model is required with the vLLM backend (derender needs it to name the served model)")

    async def served_chat_request(self, turn: BackendTurn) -> tuple[dict[str, Any], str | None]:
        """`chat_request`, under a model name the server serves: vLLM answers 404 to any other, and agents make
        side calls under their own small-model aliases. The served name, when it is not the one asked."""
        chat = self.chat_request(turn)
        asked = chat.get("model")
        served = (await self.models.get(turn.base_url, turn.headers)).name_for(asked)
        if served == asked:
            return chat, None
        chat["model"] = served
        return chat, served

    async def context_length(self, base_url: str, headers: dict[str, str]) -> int | None:
        return (await self.models.get(base_url, headers)).context_length

    async def _ask_version(self, base_url: str, headers: dict[str, str]) -> VllmVersion:
        try:
            response = await self.client.get(base_url + "/version", headers)
            text = response.json().get("version") if response.status == 200 else None
        except UpstreamUnavailable:
            raise  # nothing kept: the next turn asks again (a dead engine must not be taken for a 0.24 one)
        except (TitoError, ValueError, AttributeError):
            text = None
        version = parse_version(text if isinstance(text, str) else None)
        if version.major_minor is None:
            logger.warning("tito: %s did not say its vLLM version; using only the 0.24 wire features", base_url)
        else:
            logger.info("tito: %s speaks vLLM %s", base_url, version.text)
        return version

    @staticmethod
    def chat_request(turn: BackendTurn) -> dict[str, Any]:
        """The agent's chat body, forced to what the chain needs (also what derender's parsers read)."""
        chat = {k: v for k, v in turn.chat_body.items() if k not in ("stream_options", "input_ids")}
        chat["stream"] = False
        chat["logprobs"] = True
        if chat.get("top_logprobs") is None:
            # openai-python sends an explicit null; render would then map sampling logprobs to null, and
            # generate would return no logprobs at all.
            chat["top_logprobs"] = 0
        return chat

    async def _call(
        self, url: str, body: dict[str, Any], headers: dict[str, str], step: str, log: FailoverLog | None = None
    ) -> tuple[dict[str, Any], bytes]:
        response: UpstreamResponse = await self.client.post_json(url, body, headers, log)
        if response.status == 403:
            raise ScaleOutDisabled(
                f"vLLM refused {step} (403): start the server with --enable-scale-out (vLLM >= 0.30 registers "
                "render, generate and derender only with that flag)"
            )
        if response.status != 200:
            raise UpstreamPassthrough(response.status, response.body, response.content_type)
        try:
            parsed = response.json()
        except ValueError as exc:
            raise UpstreamMalformed(f"vLLM {step} answered 200 with a body that is not JSON") from exc
        if not isinstance(parsed, dict):
            raise UpstreamMalformed(f"vLLM {step} answered 200 with JSON that is not an object")
        return parsed, response.body

    async def run_turn(self, turn: BackendTurn) -> BackendResult:
        version = await self.versions.get(turn.base_url, turn.headers)
        chat, served = await self.served_chat_request(turn)
        generate_request, _ = await self._call(turn.base_url + RENDER_PATH, chat, turn.headers, "render", turn.failover)
        skew = render_skew(generate_request.get("token_ids"), turn.prompt_ids)
        generate_request = self.generate_request(generate_request, chat, turn.prompt_ids, version, turn)
        generated, stitched = await self.generation.run(turn, generate_request)
        generated = without_choice_routes(generated)  # read (`VllmGeneration`); derender has no use for megabytes
        completion_ids, logprobs, finish = harvest_generate(generated, turn.prompt_ids)
        # 0.32+ derender reads the prompt from the generate response's echo (checked above) and the seed field.
        compact = self.compact_requests and version.at_least(0, 32)
        seed = prompt_seed(turn.prompt_ids, turn.special_ids) if compact else turn.prompt_ids
        if compact and generated.get("prompt_token_ids") is not None:
            generated = {**generated, "prompt_token_ids": seed}
        derender_request: dict[str, Any] = {
            "model": chat["model"],
            "generate_response": generated,
            "prompt_tokens": len(turn.prompt_ids),  # 0.24's generate response has no usage
            "chat_request": derender_chat_request(chat, compact=compact, streaming=False, refuses_stop=False),
        }
        if version.at_least(0, 32):
            derender_request["prompt_token_ids"] = seed
        completion, raw = await self._call(
            turn.base_url + DERENDER_PATH, derender_request, turn.headers, "derender", turn.failover
        )
        asked_logprobs = bool(turn.chat_body.get("logprobs"))
        eos_text = turn.stop_texts.get(completion_ids[-1]) if finish == "stop" else None
        result = self.harvest_derender(
            completion, raw, completion_ids, logprobs, finish, skew, version, asked_logprobs, eos_text
        )
        weights = generated["choices"][0].get("weight_versions")  # 0.32+
        if stitched.resumed:
            result.weight_version, result.weight_version_spans = recorded_spans(weights)
            result.resumed = stitched.record()
        else:
            result.weight_version, result.weight_version_spans = weight_spans_of(weights, len(completion_ids))
        if served is not None:
            result.extra["served_model"] = served
        result.routes = stitched.routes
        return result

    @staticmethod
    def generate_request(
        rendered: dict[str, Any],
        chat: dict[str, Any],
        prompt_ids: list[int],
        version: VllmVersion,
        turn: BackendTurn | None = None,
    ) -> dict[str, Any]:
        request = dict(rendered)
        request["token_ids"] = prompt_ids
        request["stream"] = False  # render copies the chat request's flag
        request.pop("stream_options", None)
        sampling = request.get("sampling_params")
        if not isinstance(sampling, dict):
            raise UpstreamMalformed("vLLM render answered without sampling_params")
        sampling = dict(sampling)
        wanted = chat.get("max_completion_tokens") or chat.get("max_tokens")
        if isinstance(wanted, int) and "max_tokens" not in sampling:
            sampling["max_tokens"] = wanted  # vLLM render drops exactly 16 (the SamplingParams default)
        if turn is not None and turn.routes is not None:
            sampling["routed_experts_prompt_start"] = turn.routes.start
        request["sampling_params"] = sampling
        if turn is not None:
            request["features"] = placed_features(rendered.get("features"), turn.images)
        if version.at_least(0, 30):
            request["return_token_ids"] = True  # so generate proves which prompt it ran on
        return request

    async def can_stream(self, base_url: str, headers: dict[str, str]) -> bool:
        # 0.31 added streaming derender with the tool and reasoning parsers.
        return (await self.versions.get(base_url, headers)).at_least(0, 31)

    async def stream_turn(self, turn: BackendTurn) -> AsyncIterator[dict[str, Any] | StreamEnd]:
        """Streaming generate on our ids; each generate chunk goes through streaming derender (parsers
        included) and on to the agent. Ids and logprobs come from generate, exactly as in a whole turn."""
        version = await self.versions.get(turn.base_url, turn.headers)
        chat, served = await self.served_chat_request(turn)
        rendered, _ = await self._call(turn.base_url + RENDER_PATH, chat, turn.headers, "render", turn.failover)
        skew = render_skew(rendered.get("token_ids"), turn.prompt_ids)
        request = self.generate_request(rendered, chat, turn.prompt_ids, version, turn)
        request["stream"] = True
        request["stream_options"] = {"include_usage": True}
        ids: list[int] = []
        values: list[Any] = []
        accumulated = MessageAccumulator()
        state: Any = None
        finish: Any = None
        weights: Any = None  # 0.32+: on the final chunk, over the whole completion
        base: dict[str, Any] = {}
        asked_logprobs = bool(turn.chat_body.get("logprobs"))
        held = LeadingWhitespace()
        # What every derender call repeats: a seed of the prompt and the request without its messages, where the
        # family's parsers are known to read no more (`parser_inputs`), and never `stop` on 0.33.
        seed = prompt_seed(turn.prompt_ids, turn.special_ids) if self.compact_requests else turn.prompt_ids
        derender_chat = derender_chat_request(
            chat, compact=self.compact_requests, streaming=True, refuses_stop=version.at_least(0, 33)
        )
        stitched = self.generation.stitched(turn)
        events = self.generation.events(turn, request, stitched)
        # One derender call at a time: the generate chunks that arrive meanwhile go to the next call as one chunk.
        stream = batches(events)

        async def derender_steps() -> AsyncIterator[dict[str, Any]]:
            """The generate chunks to derender, checked: merged once due, or one by one where the parsers depend
            on how the output is chunked."""
            nonlocal values
            waiting: list[dict[str, Any]] = []
            sent = 0
            async for batch in stream:
                for event in batch:
                    if "error" in event:
                        raise UpstreamMalformed(f"vLLM generate stream failed: {str(event['error'])[:300]}")
                    echoed = event.get("prompt_token_ids")
                    if echoed is not None and echoed != turn.prompt_ids:
                        raise UpstreamMalformed("vLLM generate ran on different prompt ids than it was sent")
                    if event.get("choices"):
                        values += checked_stream_choice(event["choices"][0])
                        waiting.append(event)
                if not self.merge_stream_chunks:
                    for event in waiting:
                        yield event
                    waiting = []
                elif waiting and due(waiting, sent):
                    merged = merged_generate_chunk(waiting)
                    waiting = []
                    sent += len(merged["choices"][0].get("token_ids") or ())
                    yield merged
            if waiting:
                yield merged_generate_chunk(waiting)

        steps = derender_steps()
        try:
            async for event in steps:
                choice = event["choices"][0]
                delta_ids = choice["token_ids"] or []
                ids += delta_ids
                finish = choice.get("finish_reason") or finish
                weights = choice.get("weight_versions") or weights
                derender_request = {
                    "stream": True,
                    "model": chat["model"],
                    # Its echo of the whole prompt is ours to check, not derender's: the ids go below.
                    "generate_chunk": {**event, "prompt_token_ids": None},
                    "stream_state": state,
                    "prompt_tokens": len(turn.prompt_ids),
                    "prompt_token_ids": seed,
                    "chat_request": derender_chat,
                }
                derendered, _ = await self._call(
                    turn.base_url + DERENDER_PATH, derender_request, turn.headers, "derender", turn.failover
                )
                state = derendered.get("stream_state")
                chunk = derendered.get("chunk")
                if not isinstance(chunk, dict):
                    continue
                base = base or {k: chunk.get(k) for k in ("id", "object", "created", "model")}
                # The finish chunk is ours to send, after the commit; the stop token's text never shows.
                parts = [{**c, "finish_reason": None} for c in chunk.get("choices") or [] if isinstance(c, dict)]
                eos_text = turn.stop_texts.get(delta_ids[-1]) if finish == "stop" and delta_ids else None
                if eos_text:
                    parts = [{**c, "delta": _without_eos_text(c.get("delta") or {}, eos_text)} for c in parts]
                if not asked_logprobs:
                    parts = [{**c, "logprobs": None} for c in parts]
                parts = [{**c, "delta": held.take(c.get("delta") or {})} for c in parts]
                chunk = {**chunk, "choices": parts}
                accumulated.add_chunk(chunk)
                cleaned = clean_delta_chunk(chunk)
                if cleaned is not None:
                    yield cleaned
        finally:
            await steps.aclose()
            await stream.aclose()
        completion_ids = checked_ids(ids, "completion token ids")
        logprobs = checked_logprobs(values, len(completion_ids))
        if held.pending and not accumulated.calls:
            # Only whitespace came as content and no tool call followed: it is the content after all.
            late = {**base, "choices": [{"index": 0, "delta": {"content": held.pending}, "finish_reason": None}]}
            accumulated.add_chunk(late)
            yield late
        message = accumulated.message()
        finish_reason = "tool_calls" if message.get("tool_calls") and finish == "stop" else finish
        extra = {"render_skew": skew, "backend_version": version.text}
        if served is not None:
            extra["served_model"] = served
        weight = recorded_spans(weights) if stitched.resumed else weight_spans_of(weights, len(completion_ids))
        end = stream_end(turn, base, message, finish_reason, completion_ids, logprobs, extra, weight)
        end.result.resumed = stitched.record()
        end.result.routes = stitched.routes
        yield end

    @staticmethod
    def harvest_derender(
        completion: dict[str, Any],
        raw: bytes,
        completion_ids: list[int],
        logprobs: list[float],
        generate_finish: Any,
        skew: dict[str, Any] | None,
        version: VllmVersion,
        asked_logprobs: bool,
        eos_text: str | None = None,
    ) -> BackendResult:
        choices = completion.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise UpstreamMalformed("vLLM derender answered without choices: not a chat completion")
        raw_message = choices[0].get("message")
        checked_message(raw_message)
        rewritten = False
        fixed_choices = []
        for index, choice in enumerate(choices):
            message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
            if index == 0 and eos_text:
                trimmed = _without_eos_text(message, eos_text)
                if trimmed is not message:
                    # derender detokenizes the stop token when special tokens are kept (tools present);
                    # vLLM's own chat endpoint never shows it.
                    message = trimmed
                    choice = {**choice, "message": message}
                    raw_message = message
                    rewritten = True
            if message.get("tool_calls") and choice.get("finish_reason") == "stop":
                # Parity with vLLM's own chat endpoint (derender <= 0.32 passes "stop" through).
                choice = {**choice, "finish_reason": "tool_calls"}
                rewritten = True
            if not asked_logprobs and choice.get("logprobs") is not None:
                choice = {**choice, "logprobs": None}  # forced on for the record, not asked for by the agent
                rewritten = True
            fixed_choices.append(choice)
        agent_body = {**completion, "choices": fixed_choices} if rewritten else completion
        finish_reason = fixed_choices[0].get("finish_reason", generate_finish)
        if finish_reason is not None and not isinstance(finish_reason, str):
            raise UpstreamMalformed("vLLM derender returned a finish_reason that is not a string")
        return BackendResult(
            completion_ids=completion_ids,
            completion_logprobs=logprobs,
            message=trajectory_message(raw_message),
            finish_reason=finish_reason,
            agent_body=agent_body,
            agent_bytes=None if rewritten else raw,
            usage=completion.get("usage") if isinstance(completion.get("usage"), dict) else None,
            extra={"render_skew": skew, "backend_version": version.text},
        )


class LeadingWhitespace:
    """Holds back content that is only whitespace so far (the blank line between `</think>` and a tool call).

    Whole-turn derender drops such content when tool calls follow; streaming derender has already sent it. Holding
    it until real text arrives makes a streamed turn accumulate to the same message as a whole one."""

    def __init__(self) -> None:
        self.pending = ""
        self.flushed = False

    def take(self, delta: dict[str, Any]) -> dict[str, Any]:
        content = delta.get("content")
        if self.flushed or not isinstance(content, str) or not content:
            return delta
        if not content.strip():
            self.pending += content
            return {**delta, "content": None}
        self.flushed = True
        content, self.pending = self.pending + content, ""
        return {**delta, "content": content}


def _without_eos_text(message: dict[str, Any], eos_text: str) -> dict[str, Any]:
    """The message with the stop token's literal text removed from the end of its last text field."""
    for key in ("content", "reasoning", "reasoning_content"):
        value = message.get(key)
        if isinstance(value, str) and value:
            if value.endswith(eos_text):
                return {**message, key: value[: -len(eos_text)]}
            return message
    return message
