"""vLLM's ``POST /v1/chat/completions/derender``: completion ids in, a chat completion (or, streaming, one chunk)
out, parsed like vLLM's ``qwen3`` reasoning parser and ``hermes`` tool parser.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from tito_addon.replicas.replica_tokenizer import ReplicaTokenizer
from tito_addon.replicas.scripted_model import THINK_END, THINK_START, TOOL_START
from tito_addon.replicas.vllm_config import MAX_TOP_LOGPROBS, VllmEndpoint, bad_request, is_int

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


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


class DerenderEndpoint(VllmEndpoint):
    """The derender endpoint's bodies (the replica's ``_derender`` handler answers with them)."""

    def _derender_body(self, body: dict[str, Any]) -> dict[str, Any]:
        model = body.get("model")
        if model is None and not self.v32:
            raise bad_request("model: Field required", param="model")
        self._check_model(model)
        if body.get("stream") is True:
            if not self.v32:
                raise bad_request("streaming derender needs vLLM >= 0.27", param="stream")
            return self._derender_stream_chunk(body)
        gen = body.get("generate_response")
        if not isinstance(gen, dict) or not isinstance(gen.get("choices"), list):
            raise bad_request("generate_response: Field required", param="generate_response")
        if self.v32 and gen.get("output_mode", "tokens") != "tokens":
            raise bad_request(
                "generate_response must be an output_mode='tokens' response; text-mode responses are already "
                "detokenized",
                param="generate_response",
            )
        chat_request = body.get("chat_request")
        if chat_request is not None and not isinstance(chat_request, dict):
            raise bad_request("chat_request must be a ChatCompletionRequest object", param="chat_request")
        has_parser = self.config.tool_parser or self.config.reasoning_parser
        if has_parser and chat_request is None:
            raise bad_request(
                "chat_request is required when the server has a tool or reasoning parser configured",
                param="chat_request",
            )
        prompt_tokens = body.get("prompt_tokens")
        if prompt_tokens is None:
            prompt_tokens = 0
        if not is_int(prompt_tokens) or prompt_tokens < 0:
            raise bad_request("prompt_tokens must be a non-negative integer", param="prompt_tokens")

        tok = self.tokenizer
        choices: list[dict[str, Any]] = []
        completion_tokens = 0
        for ch in gen["choices"]:
            if not isinstance(ch, dict):
                raise bad_request("generate_response.choices must hold objects", param="generate_response")
            ids = ch.get("token_ids")
            index = ch.get("index", 0)
            routes = ch.get("routed_experts")
            if routes is not None and not isinstance(routes, str):  # accepted, never echoed: the choice model's type
                where = f"generate_response.choices.{len(choices)}.routed_experts"
                raise bad_request(f"{where}: Input should be a valid string", param=f"body.{where}")
            if not ids or not isinstance(ids, list):
                raise bad_request(f"choice {index} has empty or null token_ids")
            if not all(is_int(t) and 0 <= t < tok.size for t in ids):
                raise bad_request(f"choice {index} has token ids outside the vocabulary")
            if len(ids) > self.config.max_model_len:
                raise bad_request(
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
            raise bad_request("generate_chunk and chat_request are required when streaming", param="generate_chunk")
        seed = body.get("prompt_token_ids")
        if (self.config.tool_parser or self.config.reasoning_parser) and not isinstance(seed, list):
            # Any list passes: the parsers scan it backwards for their tokens, the detokenizer reads its last ids.
            raise bad_request(
                "prompt_token_ids is required for streaming derender with a parser", param="prompt_token_ids"
            )
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
            raise bad_request(f"choice {index} logprobs must be an object or null")
        content = logprobs.get("content")
        if content is None:
            return {"content": None}
        if not isinstance(content, list):
            raise bad_request(f"choice {index} logprobs.content must be a list")
        if len(content) > self.config.max_model_len:
            raise bad_request(f"logprobs.content length ({len(content)}) in choice {index} exceeds max_model_len.")
        context: list[int] = []

        def resolve(entry: Any) -> tuple[str, list[int] | None, int | None]:
            if not isinstance(entry, dict):
                raise bad_request(f"choice {index} has a malformed logprob entry")
            tid = entry.get("token_id")
            token = entry.get("token")
            if tid is None and isinstance(token, str) and token.startswith("token_id:"):
                try:
                    tid = int(token[len("token_id:") :])
                except ValueError:
                    tid = None
            if is_int(tid) and 0 <= tid < self.tokenizer.size:
                text = _token_text(self.tokenizer, tid, context)
                return text, list(text.encode("utf-8")), tid
            if isinstance(token, str):
                return token, entry.get("bytes"), None
            raise bad_request(f"choice {index} has a logprob entry without token_id")

        out: list[dict[str, Any]] = []
        for entry in content:
            token, raw, tid = resolve(entry)
            tops = entry.get("top_logprobs") or []
            if len(tops) > MAX_TOP_LOGPROBS:
                raise bad_request(f"top_logprobs count ({len(tops)}) in choice {index} exceeds maximum (20).")
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
