"""The scripted "model" both replicas serve: what it says, decided from the request alone, in Qwen3's format.

Given a conversation (the request's messages and tools, or the conversation recovered from a rendered Qwen3 prompt by
:func:`conversation_from_prompt`), :func:`script_turn` decides a turn deterministically: a ``<think>`` block when
thinking is on, content, and ``<tool_call>`` blocks (the first offered tool, arguments made up from its schema, unless
:class:`~tito_addon.replicas.sglang_replica.ReplicaConfig`'s steering knobs say otherwise; two parallel calls every
third turn). :func:`completion_text` writes it out as Qwen3 would, and :func:`logprob` is the logprob the model gives a
token at a position. Text only: the ids (and their non-canonical splits) are :mod:`replica_tokenizer`'s.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"
ASSISTANT_OPEN = "<|im_start|>assistant\n"
IM_END = "<|im_end|>"
_SEGMENT_RE = re.compile(r"<\|im_start\|>(system|user|assistant)\n(.*?)<\|im_end\|>", re.DOTALL)
_TOOLS_BLOCK_RE = re.compile(r"<tools>\n(.*?)\n</tools>", re.DOTALL)
_TOOL_RESPONSE_RE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)
_FALLBACK_WORDS = ("Paris", "Tokyo", "Zürich", "Lisbon", "São Paulo", "Oslo", "Kraków", "Nairobi")

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
    at = text.rfind(ASSISTANT_OPEN)
    if at != -1 and THINK_END in text[at + len(ASSISTANT_OPEN) :]:
        thinking = False
    return {"messages": messages, "tools": tools or None}, thinking


# --------------------------------------------------------------------------------------
# the scripted "model"
# --------------------------------------------------------------------------------------


@dataclass
class Script:
    """What the scripted model decides to say (before tokenization)."""

    reasoning: str | None  # None -> no <think> block (thinking off)
    content: str
    tool_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def text_of(content: Any) -> str:
    """Flatten OpenAI message content (str | list of parts | None) to text, as sglang does."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type", "text") == "text"
        )
    return ""


def stable_int(*parts: Any) -> int:
    raw = "\x1f".join(str(p) for p in parts).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "big")


def _derive_word(text: str, salt: int = 0) -> str:
    """A short deterministic string taken from the user's text (e.g. ``"Paris"``)."""
    words = re.findall(r"[^\W\d_][\w'-]*", text)
    capitalized = [w for i, w in enumerate(words) if i > 0 and w[:1].isupper()]
    if capitalized and salt == 0:
        return capitalized[-1]
    return _FALLBACK_WORDS[(stable_int(text) + salt) % len(_FALLBACK_WORDS)]


def _summary(text: str, limit: int = 60) -> str:
    s = " ".join(text.split())
    if len(s) > limit:
        s = s[:limit].rstrip() + "…"
    return s.rstrip(" ?!.") or "something"


def tool_functions(tools: Any) -> list[dict[str, Any]]:
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
    return _CALLED_NAME.findall(text_of(message.get("content")))


def _agent_ids(messages: list[dict[str, Any]]) -> list[str]:
    """The `agent_id`s of the conversation's tool results (Codex's spawn_agent answers `{"agent_id": …}`)."""
    ids = []
    for message in messages:
        if message.get("role") != "tool":
            continue
        try:
            found = json.loads(text_of(message.get("content")))
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


def script_turn(
    body: dict[str, Any],
    thinking: bool,
    *,
    preferred_tools: dict[str, dict[str, Any]] | None = None,
    tool_rounds: int | None = None,
    answer_sentences: int = 0,
    summary: tuple[tuple[str, ...], str] = ((), ""),
    tools_left: bool = True,
) -> Script:
    """Decide the completion deterministically from the request (messages, tools, tool_choice).

    ``preferred_tools`` and ``tool_rounds`` are :class:`ReplicaConfig`'s steering knobs; unset, the script calls the
    first offered tool when the last message is the user's and answers otherwise. ``summary`` (markers, text): a
    last user message holding a marker is a summary request, answered with the text in <summary> tags.
    """
    messages: list[dict[str, Any]] = [m for m in body["messages"] if isinstance(m, dict)]
    turn = 1 + sum(1 for m in messages if m.get("role") == "assistant")
    last = messages[-1] if messages else {}
    last_role = last.get("role")
    last_user = next((text_of(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
    word = _derive_word(last_user)

    tool_choice = body.get("tool_choice")
    fns = tool_functions(body.get("tools")) if tool_choice != "none" else []
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
            reasoning = f"The tool returned {_summary(text_of(last.get('content')), 40)}. I will answer."
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
    return Script(reasoning=reasoning if thinking else None, content=content, tool_calls=calls)


def completion_text(script: Script) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]]]:
    """Qwen3 output format.

    Also returns the character spans eligible for non-canonical splits: reasoning and
    content, plus (used only when those offer no candidate) the tool-call JSON bodies.
    """
    text = ""
    spans: list[tuple[int, int]] = []
    fallback: list[tuple[int, int]] = []
    if script.reasoning is not None:
        text = f"{THINK_START}\n"
        spans.append((len(text), len(text) + len(script.reasoning)))
        text += f"{script.reasoning}\n{THINK_END}\n\n"
    if script.content:
        spans.append((len(text), len(text) + len(script.content)))
        text += script.content
    for i, (name, args) in enumerate(script.tool_calls):
        if i > 0 or script.content:
            text += "\n"
        body = f'{{"name": "{name}", "arguments": {json.dumps(args, ensure_ascii=False)}}}'
        text += f"{TOOL_START}\n"
        fallback.append((len(text), len(text) + len(body)))
        text += f"{body}\n{TOOL_END}"
    return text, spans, fallback


def logprob(position: int, token_id: int) -> float:
    """Deterministic, finite, in (-6, 0]."""
    return -((stable_int("lp", position, token_id) % 5_999_000) / 1_000_000)
