"""A faithful, GPU-less replica of an sglang (>= 0.5.13, 0.5.18+ field names) chat server.

Purpose
-------
``tito_addon`` is a token-in/token-out (TITO) proxy: it must send exact prompt token ids
and harvest exact completion token ids.  Testing that needs a backend that

* speaks sglang's OpenAI-compatible ``POST /v1/chat/completions`` *with token input*
  (``input_ids``, ``return_prompt_token_ids``, ``return_meta_info``, ``return_token_ids``,
  ``return_{input,output}_ids_in_sglext``) exactly as described in
  ``shared/docs/wire-formats.md`` section 1;
* runs over a REAL Hugging Face tokenizer (prompt rendering, completion ids, decoding);
* is deterministic, fast and needs neither torch nor a GPU.

This module is that backend.  The "model" is a script: given the request messages it
produces a Qwen3-format completion (``<think>`` block, content, ``<tool_call>`` blocks,
``<|im_end|>``), tokenizes it, and -- on purpose -- replaces one or two ordinary tokens
with a *non-canonical* split (two vocab pieces that concatenate to the original piece).
Decoding is unchanged, but any proxy that re-tokenizes text instead of forwarding ids
loses those ids.  The reply is then post-processed the way sglang does it (reasoning
parser ``qwen3``, tool-call parser ``qwen25``): reasoning/content/tool calls are
re-derived from the decoded completion text, so a ``max_tokens`` cut behaves like the
real server.

It also simulates sglang's radix prefix cache (``meta_info.cached_tokens``), an older
server that silently ignores the token fields (``honor_input_ids=False`` ~ sglang
< 0.5.13), and a per-request fault queue for failure-path tests.

Entry points: :class:`ReferenceBackend` (asyncio), :class:`ReplicaThread` (a backend on
its own loop in a background thread, for sync tests) and :func:`main` (CLI, used by
``make demo``).  No mitmproxy, no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "FAULT_NAMES",
    "MODEL_ID",
    "ReplicaConfig",
    "ReferenceBackend",
    "ReplicaThread",
    "main",
]

log = logging.getLogger(__name__)

MODEL_ID = "reference-model"
#: sglang version this replica claims to be (``/get_server_info``), by mode.
SGLANG_VERSION = "0.5.23"
OLD_SGLANG_VERSION = "0.5.12"

#: Fault names accepted by :meth:`ReferenceBackend.set_faults` ("none" = no fault for that slot).
FAULT_NAMES: frozenset[str] = frozenset(
    {
        "none",
        "http500",
        "http429",
        "http503",
        "reset",
        "reset_early",
        "stall",
        "not_json",
        "truncated_json",
        "no_choices",
        "no_meta_info",
        "length_mismatch",
        "empty_message",
        "wrong_prompt_ids",
        "wrong_prompt_tokens",
        "nan_logprob",
    }
)
_TRANSPORT_FAULTS = frozenset(
    {"http500", "http429", "http503", "reset", "reset_early", "stall", "not_json", "truncated_json"}
)

_THINK_START = "<think>"
_THINK_END = "</think>"
_TOOL_START = "<tool_call>"
_TOOL_END = "</tool_call>"
_ASSISTANT_OPEN = "<|im_start|>assistant\n"
_SEGMENT_RE = re.compile(r"<\|im_start\|>(system|user|assistant)\n(.*?)<\|im_end\|>", re.DOTALL)
_TOOLS_BLOCK_RE = re.compile(r"<tools>\n(.*?)\n</tools>", re.DOTALL)
_TOOL_RESPONSE_RE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)
_IM_END = "<|im_end|>"
_TOOL_CALL_RE = re.compile(re.escape(_TOOL_START) + r"(.*?)" + re.escape(_TOOL_END), re.DOTALL)
_FALLBACK_WORDS = ("Paris", "Tokyo", "Zürich", "Lisbon", "São Paulo", "Oslo", "Kraków", "Nairobi")
_STREAM_FLAGS = ("return_prompt_token_ids", "return_meta_info", "return_token_ids")


# --------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------


class ReplicaConfig(BaseModel):
    """How the replica behaves.  Only ``tokenizer`` is required."""

    model_config = ConfigDict(extra="forbid")

    tokenizer: str = Field(description="HF tokenizer directory or hub name")
    honor_input_ids: bool = Field(
        default=True,
        description="False emulates sglang < 0.5.13: input_ids / return_prompt_token_ids / "
        "return_meta_info / return_token_ids / sglext flags are silently ignored",
    )
    latency_s: float = Field(default=0.0, ge=0.0, description="sleep before answering a chat request")
    version: str = Field(default=SGLANG_VERSION, description="the sglang version it reports; sglext needs 0.5.20+")
    report_version: bool = Field(default=True, description="False: the server-info routes answer 404")
    context_length: int = Field(
        default=40960,
        gt=1,
        description="the model's context length (`max_model_len` at /v1/models); like sglang, a prompt plus its "
        "max_tokens at or past it is a 400",
    )
    checkpoint_shift: float = Field(
        default=0.0, description="scoring only (/generate): logprobs of a 'newer checkpoint', shifted by this much"
    )
    noncanonical: bool = Field(default=True, description="emit deliberately non-canonical token splits")
    weight_version: str = Field(
        default="default",
        description="what meta_info.weight_version and the response's metadata.weight_version say (sglang's "
        "--weight-version; a test may change it between requests, as an update_weights call would); like sglang, "
        "streamed chat chunks carry none",
    )
    prefix_cache: bool = Field(
        default=True,
        description="simulate sglang's radix cache: meta_info.cached_tokens = longest prefix shared "
        "with an earlier prompt+completion (always < prompt length); False -> always 0",
    )
    # Steering for real agents (Claude Code, Codex), which offer a dozen tools and put context messages after the
    # prompt: by default the script calls the request's first tool with arguments made up from its schema, and only
    # when the last message is the user's. Both knobs unset keep that behaviour exactly.
    preferred_tools: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="tool name -> fixed arguments: when a call turn offers one of these tools (first listed here "
        "wins) the script calls it with these arguments instead of the first tool with made-up ones; parallel "
        "calls then repeat it. Two keys steer instead of being sent: `$once` (true: skip the tool once the "
        "conversation holds a call to it) and `$agent_ids` (an argument to fill with the `agent_id`s the "
        "conversation's tool results hold, as Codex's wait_agent needs; skip the tool while there are none)",
    )
    tool_budget: int | None = Field(
        default=None,
        ge=0,
        description="None: no limit. N: once the replica has answered N tool-call turns (since its last reset), every "
        "later turn answers: ends an agent whose contexts restart (compaction) whatever tool_rounds says",
    )
    tool_rounds: int | None = Field(
        default=None,
        ge=0,
        description="None: call a tool when the last message is the user's. N: call a tool while fewer than N "
        "assistant turns follow the last user message, whatever role comes last, then answer",
    )
    answer_sentences: int = Field(
        default=0, ge=0, description="sentences (~14 tokens each) added to every answer: long completions (benchmarks)"
    )
    # A compaction: the agent asks for a summary of the history so far (Claude Code's instruction asks for an
    # <analysis> then a <summary> block; Codex's begins "You are performing a CONTEXT CHECKPOINT COMPACTION").
    summary_markers: tuple[str, ...] = Field(
        default=("<summary>", "CONTEXT CHECKPOINT COMPACTION"),
        description="a last user message holding one of these asks for a summary: the script answers with text "
        "(never a tool call), whatever tool_rounds says",
    )
    summary_text: str = Field(
        default="The user asked about the weather; the tools were called and their results reported.",
        description="the summary the script answers a summary request with, inside <summary> tags",
    )


class _BadRequest(Exception):
    """A request sglang would answer with HTTP 400."""


# --------------------------------------------------------------------------------------
# tokenizer wrapper (shared per tokenizer path, guarded by a lock)
# --------------------------------------------------------------------------------------


class _Tokenizer:
    """Thin, thread-safe wrapper over an HF tokenizer with the ids the replica needs."""

    def __init__(self, name: str) -> None:
        from transformers import AutoTokenizer  # heavy import; keep module import cheap

        self.name = name
        self.tok: Any = AutoTokenizer.from_pretrained(name, trust_remote_code=False)
        self.lock = threading.RLock()
        self.vocab: dict[str, int] = dict(self.tok.get_vocab())
        self.size: int = len(self.tok)
        added = list(getattr(self.tok, "added_tokens_decoder", {}) or {})
        #: ids at or above this are added/special tokens; never used for splits
        self.first_added: int = min(added) if added else self.size
        self.im_end: int = self._id(_IM_END)
        self.think_end: int | None = self.vocab.get(_THINK_END)

    def _id(self, token: str) -> int:
        tid = self.tok.convert_tokens_to_ids(token)
        if not isinstance(tid, int) or tid < 0:
            raise ValueError(f"tokenizer {self.name!r} has no {token!r} token")
        return tid

    def render(self, messages: list[dict[str, Any]], tools: Any, kwargs: dict[str, Any]) -> str:
        with self.lock:
            out = self.tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
            )
        if not isinstance(out, str):  # pragma: no cover - defensive (return_dict variants)
            raise _BadRequest("chat template did not render to a string")
        return out

    def encode(self, text: str) -> list[int]:
        with self.lock:
            return list(self.tok.encode(text, add_special_tokens=False))

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        with self.lock:
            enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def decode(self, ids: list[int]) -> str:
        with self.lock:
            return str(self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def token_texts(self, ids: list[int]) -> list[str]:
        """Per-token text, as sglang's ``return_text_in_logprobs`` gives it."""
        with self.lock:
            return [
                str(self.tok.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)) for i in ids
            ]

    def piece(self, tid: int) -> str:
        with self.lock:
            return str(self.tok.convert_ids_to_tokens(tid))

    def split_of(self, tid: int) -> tuple[int, int] | None:
        """Two ordinary vocab ids whose pieces concatenate to ``tid``'s piece (middle-most cut)."""
        piece = self.piece(tid)
        cuts = sorted(range(1, len(piece)), key=lambda k: (abs(2 * k - len(piece)), k))
        for k in cuts:
            a, b = self.vocab.get(piece[:k]), self.vocab.get(piece[k:])
            if a is not None and b is not None and a < self.first_added and b < self.first_added:
                return a, b
        return None


_TOKENIZERS: dict[str, _Tokenizer] = {}
_TOKENIZERS_LOCK = threading.Lock()


def _load_tokenizer(name: str) -> _Tokenizer:
    key = str(Path(name).resolve()) if Path(name).exists() else name
    with _TOKENIZERS_LOCK:
        tok = _TOKENIZERS.get(key)
        if tok is None:
            tok = _Tokenizer(name)
            _TOKENIZERS[key] = tok
        return tok


# --------------------------------------------------------------------------------------
# Qwen3 prompt text -> the conversation the scripted model needs
# --------------------------------------------------------------------------------------


def conversation_from_prompt(text: str) -> tuple[dict[str, Any], bool]:
    """Recover ``({"messages", "tools"}, thinking)`` from a rendered Qwen3 prompt.

    Inverse of the stock Qwen3 template, as far as the script needs it: the tool list
    (``<tools>`` block of the system turn), user / assistant / tool messages (tool results
    are ``<tool_response>`` blocks inside a user turn) and whether thinking is on (off when
    the open assistant turn already holds a closed think block, i.e. ``enable_thinking=False``).
    """
    tools: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    for role, body in _SEGMENT_RE.findall(text):
        if role == "system":
            block = _TOOLS_BLOCK_RE.search(body)
            if block:
                for line in block.group(1).splitlines():
                    try:
                        tool = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(tool, dict):
                        tools.append(tool)
                body = body[: body.find("# Tools")].rstrip("\n")
            messages.append({"role": "system", "content": body})
        elif role == "user" and body.startswith("<tool_response>"):
            for result in _TOOL_RESPONSE_RE.findall(body):
                messages.append({"role": "tool", "content": result})
        else:
            messages.append({"role": role, "content": body})
    thinking = True
    at = text.rfind(_ASSISTANT_OPEN)
    if at != -1 and _THINK_END in text[at + len(_ASSISTANT_OPEN) :]:
        thinking = False
    return {"messages": messages, "tools": tools or None}, thinking


# --------------------------------------------------------------------------------------
# the scripted "model"
# --------------------------------------------------------------------------------------


@dataclass
class _Script:
    """What the scripted model decides to say (before tokenization)."""

    reasoning: str | None  # None -> no <think> block (thinking off)
    content: str
    tool_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def _text_of(content: Any) -> str:
    """Flatten OpenAI message content (str | list of parts | None) to text, as sglang does."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type", "text") == "text"
        )
    return ""


def _stable_int(*parts: Any) -> int:
    raw = "\x1f".join(str(p) for p in parts).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "big")


def _derive_word(text: str, salt: int = 0) -> str:
    """A short deterministic string taken from the user's text (e.g. ``"Paris"``)."""
    words = re.findall(r"[^\W\d_][\w'-]*", text)
    capitalized = [w for i, w in enumerate(words) if i > 0 and w[:1].isupper()]
    if capitalized and salt == 0:
        return capitalized[-1]
    return _FALLBACK_WORDS[(_stable_int(text) + salt) % len(_FALLBACK_WORDS)]


def _summary(text: str, limit: int = 60) -> str:
    s = " ".join(text.split())
    if len(s) > limit:
        s = s[:limit].rstrip() + "…"
    return s.rstrip(" ?!.") or "something"


def _tool_functions(tools: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for t in tools or []:
        if not isinstance(t, dict):
            continue
        fn = t.get("function", t)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out.append(fn)
    return out


def _arguments_for(fn: dict[str, Any], word: str) -> dict[str, Any]:
    params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    args: dict[str, Any] = {}
    for name, schema in props.items():
        schema = schema if isinstance(schema, dict) else {}
        enum = schema.get("enum")
        typ = schema.get("type")
        if isinstance(typ, list):
            typ = next((t for t in typ if t != "null"), None)
        if isinstance(enum, list) and enum:
            args[name] = enum[0]
        elif typ in ("number", "integer"):
            args[name] = 1
        elif typ == "boolean":
            args[name] = True
        elif typ == "array":
            args[name] = []
        elif typ == "object":
            args[name] = {}
        else:
            args[name] = word
    return args


def _preferred_tool(
    fns: list[dict[str, Any]], preferred: dict[str, dict[str, Any]], messages: list[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The first tool named in ``preferred`` that the request offers (the knob's order, not the request's), with its
    arguments once the steering keys are applied (`$once`, `$agent_ids`)."""
    offered = {str(f["name"]): f for f in fns}
    called = {name for m in messages if m.get("role") == "assistant" for name in _called_tools(m)}
    for name, wanted in preferred.items():
        if name not in offered or (wanted.get("$once") and name in called):
            continue
        args = {k: v for k, v in wanted.items() if k not in ("$once", "$agent_ids")}
        if wanted.get("$agent_ids"):
            ids = _agent_ids(messages)
            if not ids:
                continue
            args[str(wanted["$agent_ids"])] = ids
        return offered[name], args
    return None


_CALLED_NAME = re.compile(r'<tool_call>\s*\{"name":\s*"([^"]+)"')


def _called_tools(message: dict[str, Any]) -> list[str]:
    """The tools an assistant message called: its tool_calls, or (a conversation decoded from the prompt ids) the
    names in its <tool_call> blocks."""
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    if calls:
        return [str((call.get("function") or {}).get("name")) for call in calls]
    return _CALLED_NAME.findall(_text_of(message.get("content")))


def _agent_ids(messages: list[dict[str, Any]]) -> list[str]:
    """The `agent_id`s of the conversation's tool results (Codex's spawn_agent answers `{"agent_id": …}`)."""
    ids = []
    for message in messages:
        if message.get("role") != "tool":
            continue
        try:
            found = json.loads(_text_of(message.get("content")))
        except ValueError:
            continue
        if isinstance(found, dict) and isinstance(found.get("agent_id"), str):
            ids.append(found["agent_id"])
    return ids


def _rounds_since_prompt(messages: list[dict[str, Any]]) -> int:
    """Assistant turns after the last user message: the tool rounds already spent on the current prompt."""
    rounds = 0
    for message in reversed(messages):
        role = message.get("role")
        if role == "user":
            break
        rounds += role == "assistant"
    return rounds


def _script_turn(
    body: dict[str, Any],
    thinking: bool,
    *,
    preferred_tools: dict[str, dict[str, Any]] | None = None,
    tool_rounds: int | None = None,
    answer_sentences: int = 0,
    summary: tuple[tuple[str, ...], str] = ((), ""),
    tools_left: bool = True,
) -> _Script:
    """Decide the completion deterministically from the request (messages, tools, tool_choice).

    ``preferred_tools`` and ``tool_rounds`` are :class:`ReplicaConfig`'s steering knobs; unset, the script calls the
    first offered tool when the last message is the user's and answers otherwise. ``summary`` (markers, text): a
    last user message holding a marker is a summary request, answered with the text in <summary> tags.
    """
    messages: list[dict[str, Any]] = [m for m in body["messages"] if isinstance(m, dict)]
    turn = 1 + sum(1 for m in messages if m.get("role") == "assistant")
    last = messages[-1] if messages else {}
    last_role = last.get("role")
    last_user = next((_text_of(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
    word = _derive_word(last_user)

    tool_choice = body.get("tool_choice")
    fns = _tool_functions(body.get("tools")) if tool_choice != "none" else []
    forced: dict[str, Any] | None = None
    if isinstance(tool_choice, dict):
        wanted = (tool_choice.get("function") or {}).get("name")
        forced = next((f for f in fns if f.get("name") == wanted), None)
    if tool_rounds is None:
        wants_tool = last_role == "user"
    else:
        # Claude Code sends its environment block as a system message after the prompt, so the last role says
        # nothing; count the rounds this prompt has had instead, which also ends the agent's loop after N.
        wants_tool = _rounds_since_prompt(messages) < tool_rounds
    markers, summary_text = summary
    summarising = forced is None and any(marker in last_user for marker in markers)
    wants_tool = wants_tool and tools_left
    call_turn = not summarising and bool(fns) and (forced is not None or tool_choice == "required" or wants_tool)

    if call_turn:
        steered = _preferred_tool(fns, preferred_tools or {}, messages) if forced is None else None
        preferred = steered[0] if steered is not None else None

        def arguments(fn: dict[str, Any], salt: int) -> dict[str, Any]:
            if steered is not None:
                return dict(steered[1])
            return _arguments_for(fn, _derive_word(last_user, salt=salt) if salt else word)

        first = forced or preferred or fns[0]
        calls = [(str(first["name"]), arguments(first, 0))]
        content = ""
        if turn % 3 == 0:  # every 3rd turn: two parallel calls
            # A steered script repeats its tool: another offered tool would get made-up arguments.
            second = fns[1] if len(fns) > 1 and forced is None and preferred is None else first
            calls.append((str(second["name"]), arguments(second, 1)))
            content = "I will look up both at once."
        names = " and ".join(dict.fromkeys(n for n, _ in calls))
        reasoning = f'The user wants an answer to "{_summary(last_user)}". I will call {names}.'
    elif summarising:
        calls = []
        reasoning = "The user wants a summary of the conversation so far. I will write it."
        content = (
            f"<analysis>\nTurn {turn}: the conversation so far.\n</analysis>\n\n<summary>\n{summary_text}\n</summary>"
        )
    else:
        calls = []
        if last_role == "tool":
            reasoning = f"The tool returned {_summary(_text_of(last.get('content')), 40)}. I will answer."
        else:
            reasoning = f'The user wants an answer to "{_summary(last_user)}". I will answer.'
        fragment = json.dumps({"turn": turn, "city": word, "temp_c": 21, "ok": True}, ensure_ascii=False)
        content = (
            f"Turn {turn}: it is 21 °C near the café in {word}. "
            f"Summary: {fragment} -- computed with `round(celsius * 9 / 5 + 32)`."
        )
        readings = (f" Reading {i}: {i * 37 % 1000} units at {i % 24:02d}:00, ok." for i in range(answer_sentences))
        content += "".join(readings)
    seed = body.get("seed")
    if type(seed) is int:
        # Sampling with another seed gives another completion: samples of one prompt (a GRPO group) differ.
        reasoning += f" Sample {seed}."
        content = f"(sample {seed}) {content}" if content or not calls else content
        if calls and not thinking and not content:
            calls[0] = (calls[0][0], {**calls[0][1], "sample": seed})
    return _Script(reasoning=reasoning if thinking else None, content=content, tool_calls=calls)


def _completion_text(script: _Script) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]]]:
    """Qwen3 output format.

    Also returns the character spans eligible for non-canonical splits: reasoning and
    content, plus (used only when those offer no candidate) the tool-call JSON bodies.
    """
    text = ""
    spans: list[tuple[int, int]] = []
    fallback: list[tuple[int, int]] = []
    if script.reasoning is not None:
        text = f"{_THINK_START}\n"
        spans.append((len(text), len(text) + len(script.reasoning)))
        text += f"{script.reasoning}\n{_THINK_END}\n\n"
    if script.content:
        spans.append((len(text), len(text) + len(script.content)))
        text += script.content
    for i, (name, args) in enumerate(script.tool_calls):
        if i > 0 or script.content:
            text += "\n"
        body = f'{{"name": "{name}", "arguments": {json.dumps(args, ensure_ascii=False)}}}'
        text += f"{_TOOL_START}\n"
        fallback.append((len(text), len(text) + len(body)))
        text += f"{body}\n{_TOOL_END}"
    return text, spans, fallback


# --------------------------------------------------------------------------------------
# sglang-side post-processing (reasoning parser qwen3 + tool-call parser qwen25)
# --------------------------------------------------------------------------------------


@dataclass
class _Parsed:
    reasoning: str | None
    content: str | None
    tool_calls: list[tuple[str, str]]  # (name, arguments json string)
    reasoning_span: tuple[int, int] | None  # char span of reasoning in the decoded text
    content_span: tuple[int, int] | None  # char span of content in the decoded text
    call_ends: list[int]  # char offset just after each parsed </tool_call>
    saw_tool_start: bool


def _parse_output(
    text: str, *, separate_reasoning: bool, force_reasoning: bool, tool_names: set[str] | None
) -> _Parsed:
    """Mirror sglang's Qwen3Detector.detect_and_parse and Qwen25Detector.detect_and_parse."""
    reasoning_span: tuple[int, int] | None = None
    normal_start = 0
    if separate_reasoning and (force_reasoning or _THINK_START in text):
        p = 0
        while text.startswith(_THINK_START, p):
            p += len(_THINK_START)
        end = text.find(_THINK_END, p)
        if end == -1:
            tool = text.find(_TOOL_START, p)
            stop = tool if tool != -1 else len(text)
            reasoning_span, normal_start = (p, stop), stop
        else:
            reasoning_span, normal_start = (p, end), end + len(_THINK_END)
    content_span: tuple[int, int] | None = (normal_start, len(text))
    calls: list[tuple[str, str]] = []
    call_ends: list[int] = []
    saw_tool_start = False
    if tool_names is not None:
        idx = text.find(_TOOL_START, normal_start)
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
    return _Parsed(
        reasoning=reasoning or None,
        content=content or None,
        tool_calls=calls,
        reasoning_span=reasoning_span if reasoning else None,
        content_span=content_span if content else None,
        call_ends=call_ends,
        saw_tool_start=saw_tool_start,
    )


# --------------------------------------------------------------------------------------
# non-canonical token splits (shared with the vLLM replica)
# --------------------------------------------------------------------------------------


def _noncanonical_ids(
    tok: _Tokenizer, text: str, spans: list[tuple[int, int]], fallback: list[tuple[int, int]], *, enabled: bool
) -> tuple[list[int], list[int]]:
    """Encode ``text`` canonically, then split one ordinary token per span (at most two).

    Returns the ids and the completion indices where each split pair starts.
    """
    ids, offsets = tok.encode_with_offsets(text)
    if not enabled:
        return ids, []
    chosen = _pick_splits(tok, text, ids, offsets, spans) or _pick_splits(tok, text, ids, offsets, fallback[:1])
    out = list(ids)
    for i, pair in sorted(chosen, reverse=True):
        out[i : i + 1] = list(pair)
    if tok.decode(out) != tok.decode(ids):  # pragma: no cover - byte-level BPE guarantees this
        return ids, []
    starts = sorted(i for i, _ in chosen)
    return out, [s + k for k, s in enumerate(starts)]


def _pick_splits(
    tok: _Tokenizer, text: str, ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]
) -> list[tuple[int, tuple[int, int]]]:
    seed = _stable_int("split", text)
    chosen: list[tuple[int, tuple[int, int]]] = []
    for lo, hi in spans[:2]:
        cands: list[tuple[int, tuple[int, int]]] = []
        for i, (tid, (s, e)) in enumerate(zip(ids, offsets, strict=True)):
            if tid >= tok.first_added or not (lo <= s and e <= hi):
                continue
            core = tok.piece(tid).removeprefix("Ġ")
            if len(core) < 3 or not (core.isascii() and core.isalpha()):
                continue
            pair = tok.split_of(tid)
            if pair is not None:
                cands.append((i, pair))
        if cands:
            chosen.append(cands[seed % len(cands)])
    return chosen


#: A complete HTTP 200 whose JSON body stops mid-completion (a proxy or server that cut the body it framed).
TRUNCATED_COMPLETION = (
    b'{"id": "cut", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", '
    b'"content": "Par'
)


async def _reset_before_answering(request: web.Request) -> web.StreamResponse:
    """``reset_early``: close the connection before a single byte of the answer (a crashed or restarted server)."""
    if request.transport is not None:
        request.transport.abort()
    return web.Response(status=500)  # never sent: the connection is gone


async def _stall_or_reset(request: web.Request, fault: str, stopping: asyncio.Event | None) -> web.StreamResponse:
    """``stall``: hold the request until shutdown (or an hour); then (and for ``reset``) send
    response headers plus a few bytes of a JSON body and abort the connection."""
    if fault == "stall" and stopping is not None:
        try:
            await asyncio.wait_for(stopping.wait(), timeout=3600)
        except TimeoutError:
            pass
    resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json", "Content-Length": "4096"})
    transport = request.transport
    try:
        if transport is not None and not transport.is_closing():
            await resp.prepare(request)
            await resp.write(b'{"id": "')
    except ConnectionError:  # the client already went away
        pass
    if transport is not None:
        transport.abort()
    return resp


# --------------------------------------------------------------------------------------
# one generation
# --------------------------------------------------------------------------------------


@dataclass
class _Generation:
    rid: str
    created: int
    model: str
    prompt_ids: list[int]
    completion_ids: list[int]  # includes the final <|im_end|> when finish is stop/tool_calls
    logprobs: list[float]
    token_texts: list[str]
    text: str  # decoded completion without the stop token (what the parsers saw)
    parsed: _Parsed
    finish: dict[str, Any]  # meta_info.finish_reason (already rewritten to tool_calls)
    reasoning_tokens: int
    cached_tokens: int
    tool_call_ids: list[str]
    splits: list[int]  # completion indices where a non-canonical split starts
    e2e_latency: float


def _logprob(position: int, token_id: int) -> float:
    """Deterministic, finite, in (-6, 0]."""
    return -((_stable_int("lp", position, token_id) % 5_999_000) / 1_000_000)


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _truthy(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() in ("1", "true", "yes"))


def _error_body(message: str, code: int, err_type: str = "BadRequestError") -> dict[str, Any]:
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": code}


def _json_response(obj: Any, status: int = 200) -> web.Response:
    text = json.dumps(obj, ensure_ascii=False, allow_nan=True)
    return web.Response(status=status, text=text, content_type="application/json", charset="utf-8")


class ServedApp:
    """An aiohttp app bound on loopback, with a stop that also releases handlers stalled on purpose."""

    app: web.Application
    _stopping: asyncio.Event | None = None
    _runner: web.AppRunner | None = None
    port: int | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Bind and serve; returns the bound port."""
        self._stopping = asyncio.Event()
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()  # releases stalled handlers
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()


class ReferenceBackend(ServedApp):
    """The sglang replica: an aiohttp app plus its state (received bodies, fault queue, cache)."""

    def __init__(self, config: ReplicaConfig) -> None:
        self.config = config
        self.tokenizer = _load_tokenizer(config.tokenizer)
        self.received: list[dict[str, Any]] = []
        # What each answered chat request generated (prompt and completion ids, logprobs), in order.
        self.generated: list[dict[str, Any]] = []
        self.tool_turns = 0  # tool-call turns answered since the last reset (`tool_budget`)
        self.received_headers: list[dict[str, str]] = []
        self.scored: list[Any] = []  # bodies POSTed to native /generate (prompt scoring)
        self._faults: list[str] = []
        self._lock = threading.Lock()
        self._cache: list[list[int]] = []  # simulated radix cache (most recent last)
        self.app = web.Application(client_max_size=256 * 1024 * 1024)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/get_model_info", self._model_info)
        self.app.router.add_get("/get_server_info", self._server_info)
        self.app.router.add_get("/server_info", self._server_info)
        self.app.router.add_post("/v1/chat/completions", self._chat)
        self.app.router.add_post("/generate", self._generate_native)
        self.app.router.add_get("/_replica/requests", self._replica_requests)
        self.app.router.add_get("/_replica/generated", self._replica_generated)
        self.app.router.add_post("/_replica/faults", self._replica_faults)
        self.app.router.add_post("/_replica/reset", self._replica_reset)

    # ----------------------------------------------------------------- test controls
    def set_faults(self, faults: list[str]) -> None:
        """Replace the fault queue; each chat request pops one (FIFO). "none" = no fault."""
        bad = [f for f in faults if f not in FAULT_NAMES]
        if bad:
            raise ValueError(f"unknown fault(s) {bad}; known: {sorted(FAULT_NAMES)}")
        with self._lock:
            self._faults = list(faults)

    def pending_faults(self) -> list[str]:
        with self._lock:
            return list(self._faults)

    def received_copy(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.received)

    def reset(self) -> None:
        """Forget received bodies, pending faults and the simulated prefix cache."""
        with self._lock:
            self.received.clear()
            self.generated.clear()
            self.tool_turns = 0
            self.received_headers.clear()
            self._faults.clear()
            self._cache.clear()

    def _pop_fault(self) -> str | None:
        with self._lock:
            fault = self._faults.pop(0) if self._faults else None
        return None if fault in (None, "none") else fault

    # ----------------------------------------------------------------- small endpoints
    async def _health(self, request: web.Request) -> web.Response:
        return _json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": MODEL_ID,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": MODEL_ID,
            "max_model_len": self.config.context_length,
        }
        return _json_response({"object": "list", "data": [card]})

    async def _model_info(self, request: web.Request) -> web.Response:
        return _json_response({"model_path": MODEL_ID, "tokenizer_path": self.config.tokenizer, "is_generation": True})

    async def _server_info(self, request: web.Request) -> web.Response:
        if not self.config.report_version:
            return _json_response(_error_body("Not Found", 404), status=404)
        return _json_response(
            {
                "version": self.config.version if self.config.honor_input_ids else OLD_SGLANG_VERSION,
                "model_path": MODEL_ID,
                "served_model_name": MODEL_ID,
                "tokenizer_path": self.config.tokenizer,
                "reasoning_parser": "qwen3",
                "tool_call_parser": "qwen25",
                "reference_replica": True,
            }
        )

    async def _replica_requests(self, request: web.Request) -> web.Response:
        return _json_response(self.received_copy())

    async def _replica_generated(self, request: web.Request) -> web.Response:
        # What a separate process (a README recipe, a driver) compares its records with: the ids of each answer.
        with self._lock:
            return _json_response(list(self.generated))

    async def _replica_faults(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            faults = body["faults"]
            if not isinstance(faults, list) or not all(isinstance(f, str) for f in faults):
                raise TypeError("faults must be a list of strings")
            self.set_faults(faults)
        except (ValueError, KeyError, TypeError) as exc:
            return _json_response(_error_body(f"bad fault request: {exc}", 400), status=400)
        return _json_response({"faults": self.pending_faults()})

    async def _replica_reset(self, request: web.Request) -> web.Response:
        self.reset()
        return _json_response({"status": "ok"})

    # ----------------------------------------------------------------- native /generate (prompt scoring)
    async def _generate_native(self, request: web.Request) -> web.Response:
        """sglang's native /generate, as used to score given ids: `input_ids`, `return_logprob`,
        `logprob_start_len`, `max_new_tokens: 0` -> `meta_info.input_token_logprobs` ([logprob, id, text])."""
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            return _json_response(_error_body(f"Invalid JSON body: {exc}", 400), status=400)
        ids = body.get("input_ids") if isinstance(body, dict) else None
        with self._lock:
            self.scored.append(body)
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            return _json_response(_error_body("input_ids must be a non-empty list of ints", 400), status=400)
        start = body.get("logprob_start_len", -1)
        start = len(ids) - 1 if not isinstance(start, int) or start < 0 else start
        shift = self.config.checkpoint_shift
        # Position-relative to the scored span, the same function the chat endpoint samples with: the same
        # "checkpoint" scores a recorded completion exactly as it generated it.
        scored = [[_logprob(i - start, t) - shift, t, None] for i, t in enumerate(ids) if i >= start]
        meta = {"id": uuid.uuid4().hex, "finish_reason": {"type": "length", "length": 0},
                "prompt_tokens": len(ids), "completion_tokens": 0, "cached_tokens": 0,
                "input_token_logprobs": scored if body.get("return_logprob") else [],
                "output_token_logprobs": []}  # fmt: skip
        return _json_response({"text": "", "output_ids": [], "meta_info": meta})

    # ----------------------------------------------------------------- chat
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as exc:
            return _json_response(_error_body(f"Invalid JSON body: {exc}", 400), status=400)
        if not isinstance(body, dict):
            return _json_response(_error_body("Request body must be a JSON object.", 400), status=400)
        with self._lock:
            self.received.append(body)
            self.received_headers.append(dict(request.headers))
        fault = self._pop_fault()

        if self.config.latency_s > 0:
            await asyncio.sleep(self.config.latency_s)
        if fault in _TRANSPORT_FAULTS:
            return await self._transport_fault(request, fault)

        try:
            stream = _truthy(body.get("stream"))
            self._validate(body, stream)
            gen = self._generate(body, t0)
        except _BadRequest as exc:
            return _json_response(_error_body(str(exc), 400), status=400)
        with self._lock:
            self.generated.append(
                {"prompt_ids": gen.prompt_ids, "completion_ids": gen.completion_ids, "logprobs": gen.logprobs}
            )

        if stream:
            return await self._stream(request, body, gen)
        out = self._response_body(body, gen, request)
        if fault is not None:
            self._apply_body_fault(out, gen, fault)
        return _json_response(out)

    async def _transport_fault(self, request: web.Request, fault: str) -> web.StreamResponse:
        if fault.startswith("http"):
            code = int(fault[len("http") :])
            return _json_response({"object": "error", "message": "injected", "code": code}, status=code)
        if fault == "not_json":
            return web.Response(status=200, body=b"{weird", content_type="application/json")
        if fault == "truncated_json":
            return web.Response(status=200, body=TRUNCATED_COMPLETION, content_type="application/json")
        if fault == "reset_early":
            return await _reset_before_answering(request)
        # "stall" / "reset": headers out, then abort the connection
        return await _stall_or_reset(request, fault, self._stopping)

    def _validate(self, body: dict[str, Any], stream: bool) -> None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _BadRequest("Messages cannot be empty.")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise _BadRequest("Each message must be an object with a string 'role'.")
        if stream and self.config.honor_input_ids:
            for flag in _STREAM_FLAGS:
                if _truthy(body.get(flag)):
                    raise _BadRequest(f"{flag} is not supported with streaming (stream=true).")
        for key in ("max_tokens", "max_completion_tokens"):
            v = body.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise _BadRequest(f"{key} must be a non-negative integer.")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise _BadRequest("tools must be a list.")
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise _BadRequest("chat_template_kwargs must be an object.")

    def _prompt_ids(self, body: dict[str, Any]) -> list[int]:
        tok = self.tokenizer
        input_ids = body.get("input_ids")
        if self.config.honor_input_ids and input_ids is not None:
            if (
                not isinstance(input_ids, list)
                or not input_ids
                or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < tok.size for i in input_ids)
            ):
                raise _BadRequest("input_ids must be a non-empty list of token ids within the vocabulary.")
            return list(input_ids)
        messages = []
        for m in body["messages"]:
            m = dict(m)
            if not isinstance(m.get("content"), str) and m.get("content") is not None:
                m["content"] = _text_of(m.get("content"))
            messages.append(m)
        kwargs = {
            k: v
            for k, v in (body.get("chat_template_kwargs") or {}).items()
            if k not in ("tools", "add_generation_prompt", "tokenize", "conversation", "messages")
        }
        try:
            text = tok.render(messages, body.get("tools") or None, kwargs)
        except _BadRequest:
            raise
        except Exception as exc:  # jinja errors etc.
            raise _BadRequest(f"Failed to apply chat template: {exc}") from exc
        return tok.encode(text)

    def _check_context(self, prompt_len: int, body: dict[str, Any]) -> None:
        """sglang's own refusals (its tokenizer manager's request validation), in its words."""
        context = self.config.context_length
        if prompt_len >= context:
            raise _BadRequest(
                f"The input ({prompt_len} tokens) is longer than the model's context length ({context} tokens)."
            )
        wanted = body.get("max_completion_tokens")
        if wanted is None:
            wanted = body.get("max_tokens")
        if isinstance(wanted, int) and prompt_len + wanted >= context:
            raise _BadRequest(
                f"Requested token count exceeds the model's maximum context length of {context} tokens. You requested "
                f"a total of {prompt_len + wanted} tokens: {prompt_len} tokens from the input messages and {wanted} "
                "tokens for the completion. Please reduce the number of tokens in the input messages or the completion "
                "to fit within the limit."
            )

    def _noncanonical(
        self, text: str, spans: list[tuple[int, int]], fallback: list[tuple[int, int]]
    ) -> tuple[list[int], list[int]]:
        return _noncanonical_ids(self.tokenizer, text, spans, fallback, enabled=self.config.noncanonical)

    def _generate(self, body: dict[str, Any], t0: float) -> _Generation:
        tok = self.tokenizer
        prompt_ids = self._prompt_ids(body)
        self._check_context(len(prompt_ids), body)
        kwargs = body.get("chat_template_kwargs") or {}
        thinking = kwargs.get("enable_thinking") is not False
        script_body = body
        if self.config.honor_input_ids and body.get("input_ids") is not None:
            # The model sees only the ids: what it says follows from them, never from `messages`, which sglang's
            # parsers barely read when input_ids is given (a proxy may send a placeholder there).
            conversation, _ = conversation_from_prompt(tok.decode(prompt_ids))
            if conversation["messages"]:
                script_body = {**body, "messages": conversation["messages"]}
        script = _script_turn(
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
        full_text, spans, fallback = _completion_text(script)
        ids, splits = self._noncanonical(full_text, spans, fallback)
        ids.append(tok.im_end)

        limit = body.get("max_completion_tokens")
        if limit is None:
            limit = body.get("max_tokens")
        finish: dict[str, Any] = {"type": "stop", "matched": tok.im_end}
        if limit is not None and len(ids) > limit:
            ids = ids[:limit]
            splits = [s for s in splits if s + 1 < limit]
            finish = {"type": "length", "length": limit}
        text_ids = ids[:-1] if finish["type"] == "stop" else ids
        text = tok.decode(text_ids)

        tool_active = bool(body.get("tools")) and body.get("tool_choice") != "none"
        tool_names = {str(f["name"]) for f in _tool_functions(body.get("tools"))} if tool_active else None
        parsed = _parse_output(
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
        elif text.startswith(_THINK_START):
            reasoning_tokens = len(ids)

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

        return _Generation(
            rid=uuid.uuid4().hex,
            created=int(time.time()),
            model=body.get("model") if isinstance(body.get("model"), str) and body.get("model") else MODEL_ID,
            prompt_ids=prompt_ids,
            completion_ids=ids,
            logprobs=[_logprob(i, t) for i, t in enumerate(ids)],
            token_texts=tok.token_texts(ids),
            text=text,
            parsed=parsed,
            finish=finish,
            reasoning_tokens=reasoning_tokens,
            cached_tokens=max(cached, 0),
            tool_call_ids=[f"call_{uuid.uuid4().hex[:24]}" for _ in parsed.tool_calls],
            splits=splits,
            e2e_latency=round(time.monotonic() - t0, 6),
        )

    # ----------------------------------------------------------------- response shapes
    def _logprob_entries(self, gen: _Generation, lo: int, hi: int, top_n: int) -> list[dict[str, Any]]:
        entries = []
        for i in range(lo, hi):
            text, lp = gen.token_texts[i], gen.logprobs[i]
            top: list[dict[str, Any]] = []
            if top_n > 0:
                top.append({"token": text, "bytes": list(text.encode("utf-8")), "logprob": lp})
                for j in range(1, top_n):
                    alt = self.tokenizer.token_texts([(gen.completion_ids[i] + 7919 * j) % self.tokenizer.first_added])[
                        0
                    ]
                    top.append({"token": alt, "bytes": list(alt.encode("utf-8")), "logprob": round(lp - 1.5 * j, 6)})
            entries.append({"token": text, "bytes": list(text.encode("utf-8")), "logprob": lp, "top_logprobs": top})
        return entries

    def _meta_info(self, body: dict[str, Any], gen: _Generation, with_logprobs: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": gen.rid,
            "finish_reason": dict(gen.finish),
            "prompt_tokens": len(gen.prompt_ids),
            "weight_version": self.config.weight_version,
            "completion_tokens": len(gen.completion_ids),
            "cached_tokens": gen.cached_tokens,
            "reasoning_tokens": gen.reasoning_tokens,
            "e2e_latency": gen.e2e_latency,
        }
        if with_logprobs:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [
                [lp, tid, txt] for lp, tid, txt in zip(gen.logprobs, gen.completion_ids, gen.token_texts, strict=True)
            ]
            meta["output_token_logprobs_length"] = len(gen.completion_ids)
        return meta

    def _usage(self, gen: _Generation) -> dict[str, Any]:
        n, m = len(gen.prompt_ids), len(gen.completion_ids)
        return {
            "prompt_tokens": n,
            "completion_tokens": m,
            "total_tokens": n + m,
            "reasoning_tokens": gen.reasoning_tokens,
        }

    def _tool_calls_json(self, gen: _Generation) -> list[dict[str, Any]] | None:
        if not gen.parsed.tool_calls:
            return None
        return [
            {"id": cid, "index": i, "type": "function", "function": {"name": name, "arguments": args}}
            for i, (cid, (name, args)) in enumerate(zip(gen.tool_call_ids, gen.parsed.tool_calls, strict=True))
        ]

    def _sglext_flags(self, body: dict[str, Any], request: web.Request) -> tuple[bool, bool]:
        if not self.config.honor_input_ids or _version_tuple(self.config.version) < (0, 5, 20):
            return False, False  # sglext ids arrived in 0.5.20
        want_in = (
            _truthy(body.get("return_input_ids_in_sglext")) or request.headers.get("x-sglext-return-input-ids") == "1"
        )
        want_out = (
            _truthy(body.get("return_output_ids_in_sglext")) or request.headers.get("x-sglext-return-output-ids") == "1"
        )
        return want_in, want_out

    def _sglext(self, body: dict[str, Any], request: web.Request, gen: _Generation) -> dict[str, Any]:
        """The sglext ids block the request asked for (0.5.20+), or {} when it asked for none."""
        want_in, want_out = self._sglext_flags(body, request)
        ext: dict[str, Any] = {}
        if want_in:
            ext["input_ids"] = list(gen.prompt_ids)
        if want_out:
            ext["output_ids"] = [list(gen.completion_ids)]
        return ext

    def _response_body(self, body: dict[str, Any], gen: _Generation, request: web.Request) -> dict[str, Any]:
        honor = self.config.honor_input_ids
        want_logprobs = _truthy(body.get("logprobs"))
        top_n = body.get("top_logprobs") if isinstance(body.get("top_logprobs"), int) else 0
        choice: dict[str, Any] = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": gen.parsed.content,
                "reasoning_content": gen.parsed.reasoning,
                "tool_calls": self._tool_calls_json(gen),
            },
            "logprobs": {"content": self._logprob_entries(gen, 0, len(gen.completion_ids), top_n)}
            if want_logprobs
            else None,
            "finish_reason": gen.finish["type"],
            "matched_stop": gen.finish.get("matched"),
        }
        want_token_ids = honor and _truthy(body.get("return_token_ids"))
        if honor and (_truthy(body.get("return_prompt_token_ids")) or want_token_ids):
            choice["prompt_token_ids"] = list(gen.prompt_ids)
        if want_token_ids:
            choice["response_token_ids"] = list(gen.completion_ids)
        if honor and _truthy(body.get("return_meta_info")):
            choice["meta_info"] = self._meta_info(body, gen, want_logprobs)
        out: dict[str, Any] = {
            "id": gen.rid,
            "object": "chat.completion",
            "created": gen.created,
            "model": gen.model,
            "choices": [choice],
            "usage": self._usage(gen),
            "metadata": {"weight_version": self.config.weight_version},
        }
        ext = self._sglext(body, request, gen)
        if ext:
            out["sglext"] = ext
        return out

    def _apply_body_fault(self, out: dict[str, Any], gen: _Generation, fault: str) -> None:
        choice = out["choices"][0]
        if fault == "no_choices":
            out["choices"] = []
        elif fault == "no_meta_info":
            choice["meta_info"] = None
        elif fault == "empty_message":
            choice["message"].update({"content": None, "reasoning_content": None, "tool_calls": None})
        elif fault == "wrong_prompt_ids":
            ids = list(gen.prompt_ids)
            ids[-1] = ids[-1] + 1 if ids[-1] + 1 < self.tokenizer.size else ids[-1] - 1
            choice["prompt_token_ids"] = ids
        elif fault == "wrong_prompt_tokens":  # counted another prompt than it was sent, and did not echo it
            choice["meta_info"]["prompt_tokens"] += 1
            out["usage"]["prompt_tokens"] += 1
        elif fault in ("length_mismatch", "nan_logprob"):
            meta = choice.get("meta_info")
            if not isinstance(meta, dict) or "output_token_logprobs" not in meta:
                meta = self._meta_info({}, gen, with_logprobs=True)
                choice["meta_info"] = meta
            lps = meta["output_token_logprobs"]
            if fault == "length_mismatch":
                del lps[-1]
            else:
                lps[len(lps) // 2][0] = math.nan

    async def _stream(self, request: web.Request, body: dict[str, Any], gen: _Generation) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        framed = request.headers.get("x-sglext-ids-framed") == "1"
        for event in self._stream_events(body, gen, request):
            if isinstance(event, tuple):
                name, payload = event
                data = (
                    f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"
                    if framed
                    else f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
                )
            else:
                data = f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
            await resp.write(data.encode("utf-8"))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _stream_events(
        self, body: dict[str, Any], gen: _Generation, request: web.Request
    ) -> Iterator[dict[str, Any] | tuple[str, dict[str, Any]]]:
        want_logprobs = _truthy(body.get("logprobs"))
        top_n = body.get("top_logprobs") if isinstance(body.get("top_logprobs"), int) else 0

        def chunk(
            delta: dict[str, Any], lo: int = 0, hi: int = 0, finish: dict[str, Any] | None = None
        ) -> dict[str, Any]:
            c: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": {"content": self._logprob_entries(gen, lo, hi, top_n)}
                if want_logprobs and hi > lo
                else None,
                "finish_reason": finish["type"] if finish else None,
                "matched_stop": finish.get("matched") if finish else None,
            }
            return {
                "id": gen.rid,
                "object": "chat.completion.chunk",
                "created": gen.created,
                "model": gen.model,
                "choices": [c],
            }

        yield chunk({"role": "assistant", "content": ""})
        p = gen.parsed
        text = gen.text
        n_text = len(gen.completion_ids) - (1 if gen.finish["type"] != "length" else 0)
        lp_from, prev = 0, 0
        call_ids = self._tool_calls_json(gen) or []
        next_call = 0
        for i in range(n_text):
            cur = self.tokenizer.decode(gen.completion_ids[: i + 1])
            cur_len = len(os.path.commonprefix([cur, text]))
            if cur_len <= prev and not (i == n_text - 1):
                continue
            out: list[dict[str, Any]] = []
            for key, span in (("reasoning_content", p.reasoning_span), ("content", p.content_span)):
                if span is not None:
                    lo, hi = max(prev, span[0]), min(cur_len, span[1])
                    if hi > lo:
                        out.append({key: text[lo:hi]})
            while next_call < len(p.call_ends) and p.call_ends[next_call] <= cur_len:
                tc = call_ids[next_call]
                out.append(
                    {
                        "tool_calls": [
                            {
                                "index": tc["index"],
                                "id": tc["id"],
                                "type": "function",
                                "function": {"name": tc["function"]["name"], "arguments": ""},
                            }
                        ]
                    }
                )
                out.append(
                    {"tool_calls": [{"index": tc["index"], "function": {"arguments": tc["function"]["arguments"]}}]}
                )
                next_call += 1
            prev = max(prev, cur_len)
            for k, delta in enumerate(out):
                if k == 0:
                    yield chunk(delta, lp_from, i + 1)
                    lp_from = i + 1
                else:
                    yield chunk(delta)
        yield chunk({}, lp_from, len(gen.completion_ids), finish=gen.finish)
        ext = self._sglext(body, request, gen)
        if ext:
            yield (
                "sglext_ids",
                {
                    "id": gen.rid,
                    "object": "chat.completion.chunk",
                    "created": gen.created,
                    "model": gen.model,
                    "choices": [],
                    "sglext": ext,
                },
            )
        opts = body.get("stream_options")
        if isinstance(opts, dict) and _truthy(opts.get("include_usage")):
            yield {
                "id": gen.rid,
                "object": "chat.completion.chunk",
                "created": gen.created,
                "model": gen.model,
                "choices": [],
                "usage": self._usage(gen),
            }


# --------------------------------------------------------------------------------------
# background-thread helper for sync tests
# --------------------------------------------------------------------------------------


class ReplicaThread:
    """Run a :class:`ReferenceBackend` on its own event loop in a daemon thread.

    >>> with ReplicaThread(ReplicaConfig(tokenizer="../shared/tokenizers/qwen3")) as r:  # doctest: +SKIP
    ...     requests.post(r.url + "/v1/chat/completions", json={...})
    """

    def __init__(
        self, config: ReplicaConfig | str, host: str = "127.0.0.1", port: int = 0, start_timeout: float = 60.0
    ) -> None:
        self.config = self._coerce_config(config)
        self.host = host
        self._want_port = port
        self._start_timeout = start_timeout
        self.backend = self._make_backend(self.config)
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    #: name of the background thread (subclasses serving another replica override it)
    thread_name = "reference-backend"

    @staticmethod
    def _coerce_config(config: Any) -> Any:
        return config if isinstance(config, ReplicaConfig) else ReplicaConfig(tokenizer=str(config))

    def _make_backend(self, config: Any) -> Any:
        """The backend to serve; it needs start/stop, received_copy, generated, _lock, set_faults, reset."""
        return ReferenceBackend(config)

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("replica not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> ReplicaThread:
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()
        if not self._ready.wait(self._start_timeout):
            raise RuntimeError("reference backend did not start in time")
        if self._error is not None:
            raise RuntimeError(f"reference backend failed to start: {self._error!r}") from self._error
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            self.port = loop.run_until_complete(self.backend.start(self.host, self._want_port))
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self.backend.stop())
            loop.close()

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        self._thread = None
        self._loop = None

    def received(self) -> list[dict[str, Any]]:
        return self.backend.received_copy()

    def generated(self) -> list[dict[str, Any]]:
        with self.backend._lock:
            return list(self.backend.generated)

    def set_faults(self, faults: list[str]) -> None:
        self.backend.set_faults(faults)

    def clear(self) -> None:
        self.backend.reset()

    def __enter__(self) -> ReplicaThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


async def _serve(config: ReplicaConfig, host: str, port: int, port_file: str | None) -> None:
    backend = ReferenceBackend(config)
    bound = await backend.start(host, port)
    shown = f"[{host}]" if ":" in host else host
    print(f"reference backend listening on http://{shown}:{bound}", flush=True)
    if port_file:
        tmp = Path(port_file + ".tmp")
        tmp.write_text(f"{bound}\n")
        os.replace(tmp, port_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-main thread / Windows
            pass
    try:
        await stop.wait()
    finally:
        await backend.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m tito_addon reference-backend --tokenizer DIR [--port N] ...``"""
    # This process loads a tokenizer only: transformers' advice that PyTorch is missing would read as a fault.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    ap = argparse.ArgumentParser(
        prog="python -m tito_addon reference-backend",
        description="sglang-compatible reference backend (scripted model over a real HF tokenizer).",
        epilog="A CLI agent's own tools, e.g. Claude Code's shell for 3 rounds per prompt, then an answer: "
        """--call-tool 'Bash={"command": "ls"}' --tool-rounds 3 (Codex: exec_command={"cmd": "ls"}).""",
    )
    ap.add_argument("--tokenizer", required=True, help="HF tokenizer directory or hub name")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000, help="0 = any free port")
    ap.add_argument("--port-file", default=None, help="write the bound port to this file once listening")
    ap.add_argument("--latency", type=float, default=0.0, help="seconds to sleep before each chat answer")
    ap.add_argument("--old-sglang", action="store_true", help="emulate sglang < 0.5.13 (ignores input_ids etc.)")
    ap.add_argument("--canonical", action="store_true", help="do not emit non-canonical token splits")
    ap.add_argument("--no-prefix-cache", action="store_true", help="always report cached_tokens 0")
    ap.add_argument(
        "--call-tool",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="on a call turn, call tool NAME with these arguments (a JSON object) when the request offers it; "
        "repeatable, the first one offered wins (default: the request's first tool, arguments made up from its "
        'schema). Two keys of the JSON steer instead of being sent: "$once": true (not again once the conversation '
        'holds a call to it) and "$agent_ids": "ARG" (fill ARG with the agent ids earlier tool results hold)',
    )
    ap.add_argument(
        "--tool-budget",
        type=int,
        default=None,
        metavar="N",
        help="after N tool-call turns (all conversations together) every turn answers: ends an agent whose "
        "contexts restart at each compaction (default: no limit)",
    )
    ap.add_argument(
        "--tool-rounds",
        type=int,
        default=None,
        metavar="N",
        help="call a tool while fewer than N assistant turns follow the last user message, whatever comes last "
        "(an agent's context messages included), then answer (default: call when the user spoke last)",
    )
    ap.add_argument(
        "--summary-answer",
        default=None,
        metavar="TEXT",
        help="the summary a compaction request gets (a last user message holding <summary> or CONTEXT CHECKPOINT "
        "COMPACTION): a text answer with this inside <summary> tags, never a tool call",
    )
    ap.add_argument(
        "--context-length",
        type=int,
        default=40960,
        metavar="N",
        help="the model's context length it reports at /v1/models; a prompt plus its max_tokens at or past it is a "
        "400, in sglang's words (default: 40960, Qwen3's)",
    )
    args = ap.parse_args(argv)
    preferred: dict[str, dict[str, Any]] = {}
    for spec in args.call_tool:
        name, separator, arguments = spec.partition("=")
        try:
            parsed = json.loads(arguments) if separator else None
        except ValueError as exc:
            ap.error(f"--call-tool {spec!r}: the arguments are not JSON: {exc}")
        if not name or not isinstance(parsed, dict):
            ap.error(f"--call-tool {spec!r}: expected NAME=JSON, the JSON an object")
        preferred.setdefault(name, parsed)
    if args.tool_rounds is not None and args.tool_rounds < 0:
        ap.error("--tool-rounds must be 0 or more")
    if args.tool_budget is not None and args.tool_budget < 0:
        ap.error("--tool-budget must be 0 or more")
    if args.context_length < 2:
        ap.error("--context-length must be 2 or more")
    config = ReplicaConfig(
        tokenizer=args.tokenizer,
        honor_input_ids=not args.old_sglang,
        latency_s=args.latency,
        noncanonical=not args.canonical,
        prefix_cache=not args.no_prefix_cache,
        preferred_tools=preferred,
        tool_rounds=args.tool_rounds,
        tool_budget=args.tool_budget,
        context_length=args.context_length,
        **({"summary_text": args.summary_answer} if args.summary_answer is not None else {}),
    )
    try:
        asyncio.run(_serve(config, args.host, args.port, args.port_file))
    except KeyboardInterrupt:  # pragma: no cover - signal handler normally catches it
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
