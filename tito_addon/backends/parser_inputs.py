"""What a server's parsers are sent besides the ids: vLLM's derender a seed of the prompt and the chat request
without its conversation; sglang's chat endpoint (given `input_ids`) the request without its conversation.

Sending the whole prompt and the whole conversation on every streaming derender call made a streamed turn move
(calls × history) bytes: at a 100k-token history, hundreds of megabytes for one answer. vLLM 0.31-0.33 read far
less of them (measured on their derender code with each family's reasoning and tool parsers):
- of `prompt_token_ids`: the last few ids, which seed the incremental detokenizer (0.32+ takes 7), and the
  reasoning parsers' backward scan for their start and end tokens, which only asks which special token came last;
- of `chat_request`: the tools, tool_choice, template kwargs and sampling fields the parsers consult, never the
  messages (only Kimi's parser reads them, which no family here uses).
So, for a family whose server parsers are known (`ModelFamily.compact_requests`), the prompt is cut to the last
occurrence of each special token plus its last ids, in their original order, and the messages to one empty user
message (the request model needs at least one). Unknown families keep the whole of both.

sglang (0.5.13-0.5.23, read in each release's serving code) never renders or tokenizes `messages` when `input_ids`
is given; of them it reads only that the list is not empty, the last message when `continue_final_message` asks to
continue an assistant prefill (its reasoning parser checks that prefill for think tags), and from 0.5.17 the `tools`
that a system or developer message may carry. Yet it parses the whole list on every turn: ~350 KB of messages at a
long agent history, a quarter of the body. `sglang_messages` keeps exactly what it reads.
"""

from __future__ import annotations

from typing import Any

# vLLM 0.32's detokenizer seeds its state with the prompt's last 7 ids (INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
# + 1); more are kept so that a later version reading a few more still sees the real ones.
PROMPT_TAIL = 16
PLACEHOLDER_MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": ""}]
# Roles whose `tools` field sglang 0.5.17+ reads as the request's tools.
TOOL_ROLES = ("system", "developer", "root")


def prompt_seed(prompt_ids: list[int], special_ids: frozenset[int], tail: int = PROMPT_TAIL) -> list[int]:
    """The last occurrence of every special token in `prompt_ids`, then its last `tail` ids, in prompt order.

    Any backward scan for a set of special tokens ("which of these came last?") and any detokenizer seeded from the
    last `tail` ids give the same answer on the seed as on the whole prompt."""
    if len(prompt_ids) <= tail:
        return list(prompt_ids)
    head = len(prompt_ids) - tail
    # One copy of the head, reversed: the set of special tokens in it, then (list.index runs in C) each one's last
    # occurrence, without a Python loop over ~100k ids on every vLLM turn.
    reversed_head = prompt_ids[head - 1 :: -1]
    present = special_ids.intersection(reversed_head)
    if not present:
        return prompt_ids[head:]
    positions = sorted(head - 1 - reversed_head.index(token) for token in present)
    return [prompt_ids[p] for p in positions] + prompt_ids[head:]


def derender_chat_request(
    chat: dict[str, Any], *, compact: bool, streaming: bool, refuses_stop: bool
) -> dict[str, Any]:
    """The chat request derender's parsers read. `refuses_stop`: vLLM 0.33's streaming derender answers 400 to a
    chat request with `stop` (generate already applied the stop strings; derender only decodes and parses)."""
    if not compact and not (streaming and refuses_stop):
        return chat
    out = dict(chat)
    if compact:
        out["messages"] = PLACEHOLDER_MESSAGES
    if streaming and refuses_stop:
        out.pop("stop", None)
    return out


def sglang_messages(messages: list[Any], continue_final_message: Any) -> list[Any]:
    """The messages sglang's chat endpoint reads when given `input_ids`: system or developer messages that carry
    tools, then the assistant prefill it is asked to continue, or else one empty user message."""
    kept = [m for m in messages if isinstance(m, dict) and m.get("role") in TOOL_ROLES and m.get("tools")]
    last = messages[-1] if messages else None
    continues = continue_final_message is True and isinstance(last, dict) and last.get("role") == "assistant"
    return [*kept, last if continues else PLACEHOLDER_MESSAGES[0]]
