"""One sglang chat generation: the request checked as sglang checks it, its prompt ids, the script's completion
(with its non-canonical splits and ``max_tokens`` cut), and sglang's parsers over the decoded text.

The parsers are sglang's post-processing (reasoning parser ``qwen3``, tool-call parser ``qwen25``): reasoning, content
and tool calls are re-derived from the decoded completion text, so a ``max_tokens`` cut behaves like the real server;
their character spans let the stream cut the same text into deltas. :class:`SglangGeneration` is mixed into
:class:`~tito_addon.replicas.sglang_replica.ReferenceBackend`, whose state it reads.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tito_addon.replicas.engine_pause import EnginePause
from tito_addon.replicas.replica_tokenizer import ReplicaTokenizer, noncanonical_ids
from tito_addon.replicas.scripted_model import (
    THINK_END,
    THINK_START,
    TOOL_END,
    TOOL_START,
    completion_text,
    conversation_from_prompt,
    logprob,
    script_turn,
    text_of,
    tool_functions,
)
from tito_addon.replicas.sglang_config import MODEL_ID, ReplicaConfig
from tito_addon.replicas.vision_processing import described

_TOOL_CALL_RE = re.compile(re.escape(TOOL_START) + r"(.*?)" + re.escape(TOOL_END), re.DOTALL)
_STREAM_FLAGS = ("return_prompt_token_ids", "return_meta_info", "return_token_ids")


class BadRequest(Exception):
    """A request sglang would answer with HTTP 400."""


class AbortedRequest(BadRequest):
    """A request sglang's scheduler ends at once with an error abort (status 400): whole, the 400 error body; streamed,
    an error chunk in a 200 stream."""


def truthy(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() in ("1", "true", "yes"))


# --------------------------------------------------------------------------------------
# sglang-side post-processing (reasoning parser qwen3 + tool-call parser qwen25)
# --------------------------------------------------------------------------------------


@dataclass
class ParsedOutput:
    reasoning: str | None
    content: str | None
    tool_calls: list[tuple[str, str]]  # (name, arguments json string)
    reasoning_span: tuple[int, int] | None  # char span of reasoning in the decoded text
    content_span: tuple[int, int] | None  # char span of content in the decoded text
    call_ends: list[int]  # char offset just after each parsed </tool_call>
    saw_tool_start: bool


def reasoning_split(text: str, force_reasoning: bool) -> tuple[tuple[int, int] | None, int]:
    """The qwen3 reasoning parser's cut: the reasoning's char span (None when there is no block) and where the
    normal text starts (after `</think>`; an unclosed block runs to a tool call or the end)."""
    if not (force_reasoning or THINK_START in text):
        return None, 0
    p = 0
    while text.startswith(THINK_START, p):
        p += len(THINK_START)
    end = text.find(THINK_END, p)
    if end == -1:
        tool = text.find(TOOL_START, p)
        stop = tool if tool != -1 else len(text)
        return (p, stop), stop
    return (p, end), end + len(THINK_END)


def parse_output(
    text: str, *, separate_reasoning: bool, force_reasoning: bool, tool_names: set[str] | None
) -> ParsedOutput:
    """Mirror sglang's Qwen3Detector.detect_and_parse and Qwen25Detector.detect_and_parse."""
    reasoning_span: tuple[int, int] | None = None
    normal_start = 0
    if separate_reasoning:
        reasoning_span, normal_start = reasoning_split(text, force_reasoning)
    content_span: tuple[int, int] | None = (normal_start, len(text))
    calls: list[tuple[str, str]] = []
    call_ends: list[int] = []
    saw_tool_start = False
    if tool_names is not None:
        idx = text.find(TOOL_START, normal_start)
        if idx != -1:
            saw_tool_start = True
            seg = text[normal_start:idx]
            lead = len(seg) - len(seg.lstrip())
            stripped = seg.strip()
            content_span = (normal_start + lead, normal_start + lead + len(stripped))
            for m in _TOOL_CALL_RE.finditer(text, normal_start):
                try:
                    obj = json.loads(m.group(1).strip())
                except json.JSONDecodeError:
                    continue
                if not isinstance(obj, dict) or obj.get("name") not in tool_names:
                    continue
                args = obj.get("parameters") or obj.get("arguments", {})
                calls.append((str(obj["name"]), json.dumps(args, ensure_ascii=False)))
                call_ends.append(m.end())
    reasoning = text[reasoning_span[0] : reasoning_span[1]] if reasoning_span else ""
    content = text[content_span[0] : content_span[1]] if content_span else ""
    return ParsedOutput(
        reasoning=reasoning or None,
        content=content or None,
        tool_calls=calls,
        reasoning_span=reasoning_span if reasoning else None,
        content_span=content_span if content else None,
        call_ends=call_ends,
        saw_tool_start=saw_tool_start,
    )


# --------------------------------------------------------------------------------------
# one generation
# --------------------------------------------------------------------------------------


@dataclass
class Generation:
    rid: str
    created: int
    model: str
    prompt_ids: list[int]
    completion_ids: list[int]  # includes the final <|im_end|> when finish is stop/tool_calls
    logprobs: list[float]
    token_texts: list[str]
    text: str  # decoded completion without the stop token (what the parsers saw)
    parsed: ParsedOutput
    finish: dict[str, Any]  # meta_info.finish_reason (already rewritten to tool_calls)
    reasoning_tokens: int
    cached_tokens: int
    tool_call_ids: list[str]
    splits: list[int]  # completion indices where a non-canonical split starts
    e2e_latency: float
    root: list[int] = field(default_factory=list)  # the prompt the generation was first asked with
    plan: list[int] = field(default_factory=list)  # everything it will have sampled after `root`, if never cut
    labels: list[str] = field(default_factory=list)  # the weight label each sampled token was stamped with


#: sglang's `FINISH_ABORT()` of a pause, `/abort_request` or `/update_weight_version`: no error status.
ABORT_FINISH = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


class SglangGeneration:
    """What a chat request generates, mixed into the replica: reads its config and tokenizer, counts its tool turns
    and keeps its simulated radix cache (``meta_info.cached_tokens``), both under its lock."""

    config: ReplicaConfig
    tokenizer: ReplicaTokenizer
    tool_turns: int
    pause: EnginePause
    _lock: threading.Lock
    _cache: list[list[int]]

    def _validate(self, body: dict[str, Any], stream: bool) -> None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("Messages cannot be empty.")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise BadRequest("Each message must be an object with a string 'role'.")
        if stream and self.config.honor_input_ids:
            for flag in _STREAM_FLAGS:
                if truthy(body.get(flag)):
                    raise BadRequest(f"{flag} is not supported with streaming (stream=true).")
        for key in ("max_tokens", "max_completion_tokens"):
            v = body.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise BadRequest(f"{key} must be a non-negative integer.")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise BadRequest("tools must be a list.")
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise BadRequest("chat_template_kwargs must be an object.")

    def _prompt_ids(self, body: dict[str, Any]) -> list[int]:
        tok = self.tokenizer
        input_ids = body.get("input_ids")
        if self.config.honor_input_ids and input_ids is not None:
            if (
                not isinstance(input_ids, list)
                or not input_ids
                or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < tok.size for i in input_ids)
            ):
                raise BadRequest("input_ids must be a non-empty list of token ids within the vocabulary.")
            return list(input_ids)
        messages = []
        for m in body["messages"]:
            m = dict(m)
            if not isinstance(m.get("content"), str) and m.get("content") is not None:
                m["content"] = text_of(m.get("content"))
            messages.append(m)
        kwargs = {
            k: v
            for k, v in (body.get("chat_template_kwargs") or {}).items()
            if k not in ("tools", "add_generation_prompt", "tokenize", "conversation", "messages")
        }
        try:
            text = tok.render(messages, body.get("tools") or None, kwargs)
        except Exception as exc:  # jinja errors etc.
            raise BadRequest(f"Failed to apply chat template: {exc}") from exc
        return tok.encode(text)

    def _check_context(self, prompt_len: int, body: dict[str, Any]) -> None:
        """sglang's own refusals (its tokenizer manager's request validation), in its words."""
        context = self.config.context_length
        if prompt_len >= context:
            raise BadRequest(
                f"The input ({prompt_len} tokens) is longer than the model's context length ({context} tokens)."
            )
        wanted = body.get("max_completion_tokens")
        if wanted is None:
            wanted = body.get("max_tokens")
        if isinstance(wanted, int) and prompt_len + wanted >= context:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {context} tokens. You requested "
                f"a total of {prompt_len + wanted} tokens: {prompt_len} tokens from the input messages and {wanted} "
                "tokens for the completion. Please reduce the number of tokens in the input messages or the completion "
                "to fit within the limit."
            )

    def _check_routes_start(self, prompt_len: int, body: dict[str, Any]) -> None:
        """sglang >= 0.5.13's scheduler check of `routed_experts_start_len` (in [0, prompt length]), made whenever the
        request asks for routes, the server flag on or off; it aborts the request with this message."""
        if not self.config.honor_input_ids or not truthy(body.get("return_routed_experts")):
            return
        start = body.get("routed_experts_start_len", 0)
        if not isinstance(start, int) or isinstance(start, bool):
            raise BadRequest("routed_experts_start_len must be an integer.")
        if start < 0:
            raise AbortedRequest(
                f"recv_req.routed_experts_start_len={start} is lower than 0. Please use a non-negative "
                "routed_experts_start_len."
            )
        if start > prompt_len:
            raise AbortedRequest(
                f"recv_req.routed_experts_start_len={start} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={prompt_len}. Please use a smaller routed_experts_start_len."
            )

    def _noncanonical(
        self, text: str, spans: list[tuple[int, int]], fallback: list[tuple[int, int]]
    ) -> tuple[list[int], list[int]]:
        return noncanonical_ids(self.tokenizer, text, spans, fallback, enabled=self.config.noncanonical)

    def _generate(self, body: dict[str, Any], t0: float) -> Generation:
        tok = self.tokenizer
        prompt_ids = self._prompt_ids(body)
        self._check_context(len(prompt_ids), body)
        self._check_routes_start(len(prompt_ids), body)
        kwargs = body.get("chat_template_kwargs") or {}
        thinking = kwargs.get("enable_thinking") is not False
        continued = self.pause.continuation(prompt_ids) if self.config.honor_input_ids else None
        if continued is not None:  # a cut generation's prompt + partial output: it goes on where it was cut
            return self._continued(body, prompt_ids, continued[0], continued[1], t0)
        script_body = body
        if self.config.honor_input_ids and body.get("input_ids") is not None:
            # The model sees only the ids: what it says follows from them, never from `messages`, which sglang's
            # parsers barely read when input_ids is given (a proxy may send a placeholder there).
            conversation, _ = conversation_from_prompt(described(tok.decode(prompt_ids), body.get("_images") or []))
            if conversation["messages"]:
                script_body = {**body, "messages": conversation["messages"]}
        script = script_turn(
            script_body,
            thinking,
            preferred_tools=self.config.preferred_tools,
            tool_rounds=self.config.tool_rounds,
            answer_sentences=self.config.answer_sentences,
            summary=(self.config.summary_markers, self.config.summary_text),
            tools_left=self.config.tool_budget is None or self.tool_turns < self.config.tool_budget,
        )
        if script.tool_calls:
            with self._lock:
                self.tool_turns += 1
        full_text, spans, fallback = completion_text(script)
        ids, splits = self._noncanonical(full_text, spans, fallback)
        ids.append(tok.im_end)

        plan = list(ids)
        ids, finish, splits = self._budgeted(body, ids, splits)
        text, parsed, finish, reasoning_tokens = self._parse(body, ids, finish)

        cached = 0
        if self.config.prefix_cache:
            with self._lock:
                for seq in self._cache:
                    n = 0
                    for a, b in zip(seq, prompt_ids, strict=False):
                        if a != b:
                            break
                        n += 1
                    cached = max(cached, n)
                self._cache.append(prompt_ids + ids)
                del self._cache[:-256]
            cached = min(cached, len(prompt_ids) - 1)

        return Generation(
            rid=uuid.uuid4().hex,
            created=int(time.time()),
            model=body.get("model") if isinstance(body.get("model"), str) and body.get("model") else MODEL_ID,
            prompt_ids=prompt_ids,
            completion_ids=ids,
            logprobs=[logprob(i, t) for i, t in enumerate(ids)],
            token_texts=tok.token_texts(ids),
            text=text,
            parsed=parsed,
            finish=finish,
            reasoning_tokens=reasoning_tokens,
            cached_tokens=max(cached, 0),
            tool_call_ids=[f"call_{uuid.uuid4().hex[:24]}" for _ in parsed.tool_calls],
            splits=splits,
            e2e_latency=round(time.monotonic() - t0, 6),
            root=prompt_ids,
            plan=plan,
        )

    def _budgeted(
        self, body: dict[str, Any], ids: list[int], splits: list[int]
    ) -> tuple[list[int], dict[str, Any], list[int]]:
        """The planned ids within the request's budget, how they finish, and the splits left in them."""
        limit = body.get("max_completion_tokens")
        if limit is None:
            limit = body.get("max_tokens")
        finish: dict[str, Any] = {"type": "stop", "matched": self.tokenizer.im_end}
        if limit is not None and len(ids) > limit:
            ids = ids[:limit]
            splits = [s for s in splits if s + 1 < limit]
            finish = {"type": "length", "length": limit}
        stopped = self.tokenizer.stop_in(ids, body.get("stop"))
        if stopped is not None:
            count, matched = stopped
            ids, finish = ids[:count], {"type": "stop", "matched": matched}
            splits = [s for s in splits if s + 1 < count]
        return ids, finish, splits

    def _parse(
        self, body: dict[str, Any], ids: list[int], finish: dict[str, Any]
    ) -> tuple[str, ParsedOutput, dict[str, Any], int]:
        """What sglang's chat makes of this request's output alone: the text (its stop token off), the parse, the
        finish reason (`tool_calls` once a call began in a stopped output), the reasoning tokens."""
        tok = self.tokenizer
        kwargs = body.get("chat_template_kwargs") or {}
        if isinstance(finish.get("matched"), str):  # a stop string: its tokens are kept, its text cut
            text = tok.decode(ids)
            text = text[: text.find(finish["matched"])]
        else:
            text = tok.decode(ids[:-1] if finish["type"] == "stop" else ids)
        tool_active = bool(body.get("tools")) and body.get("tool_choice") != "none"
        tool_names = {str(f["name"]) for f in tool_functions(body.get("tools"))} if tool_active else None
        parsed = parse_output(
            text,
            separate_reasoning=body.get("separate_reasoning", True) is not False,
            force_reasoning=kwargs.get("enable_thinking") is True,
            tool_names=tool_names,
        )
        if parsed.saw_tool_start and finish["type"] == "stop":
            finish = {"type": "tool_calls", "matched": None}
        reasoning_tokens = 0
        if tok.think_end is not None and tok.think_end in ids:
            reasoning_tokens = ids.index(tok.think_end) + 1
        elif text.startswith(THINK_START):
            reasoning_tokens = len(ids)
        return text, parsed, finish, reasoning_tokens

    def _continued(
        self, body: dict[str, Any], prompt_ids: list[int], rest: list[int], offset: int, t0: float
    ) -> Generation:
        """The rest of a cut generation, sampled as the uncut one would have (the same ids, their log-probs at their
        place in the whole completion) and parsed, as sglang parses, on this request's output alone."""
        ids, finish, _ = self._budgeted(body, list(rest), [])
        text, parsed, finish, reasoning_tokens = self._parse(body, ids, finish)
        root = prompt_ids[: len(prompt_ids) - offset]
        return Generation(
            rid=uuid.uuid4().hex,
            created=int(time.time()),
            model=body.get("model") if isinstance(body.get("model"), str) and body.get("model") else MODEL_ID,
            prompt_ids=prompt_ids,
            completion_ids=ids,
            logprobs=[logprob(offset + i, t) for i, t in enumerate(ids)],
            token_texts=self.tokenizer.token_texts(ids),
            text=text,
            parsed=parsed,
            finish=finish,
            reasoning_tokens=reasoning_tokens,
            cached_tokens=len(prompt_ids) - 1,
            tool_call_ids=[f"call_{uuid.uuid4().hex[:24]}" for _ in parsed.tool_calls],
            splits=[],
            e2e_latency=round(time.monotonic() - t0, 6),
            root=root,
            plan=prompt_ids[len(root) :] + rest,
        )

    def cut(self, body: dict[str, Any], gen: Generation, produced: int) -> None:
        """The engine aborted the generation after `produced` tokens: it answers with those (parsed as they are: a
        tool call cut short is no call), finish `abort`, and its plan is kept for a resubmission to continue."""
        self.pause.remember(gen.root, gen.plan)
        gen.completion_ids = gen.completion_ids[:produced]
        gen.logprobs, gen.token_texts = gen.logprobs[:produced], gen.token_texts[:produced]
        gen.splits = [s for s in gen.splits if s + 1 < produced]
        gen.text, gen.parsed, _, gen.reasoning_tokens = self._parse(body, gen.completion_ids, {"type": "length"})
        gen.tool_call_ids = [f"call_{uuid.uuid4().hex[:24]}" for _ in gen.parsed.tool_calls]
        gen.finish = dict(ABORT_FINISH)
