"""A turn's completion budget, cut to what the backend's context leaves after the prompt.

Claude Code asks for `max_tokens` up to 128k whatever the model; a server refuses a turn whose prompt and budget
pass its context (vLLM past `max_model_len`, sglang at its context length). The proxy knows the prompt's exact
length, so it sends the largest budget both servers accept, one token short of the context, and the record says so
(`completion_budget`). A prompt that leaves no room at all is refused before anything is forwarded.
"""

from __future__ import annotations

from typing import Any

from tito_addon.tito_errors import BadRequest

BUDGET_FIELDS = ("max_tokens", "max_completion_tokens")


def fit_completion_budget(chat_body: dict[str, Any], prompt_len: int, context_length: int | None) -> dict | None:
    """Cut the budget fields of `chat_body` (the backend's copy) to the room the context leaves; what was cut, for the
    record, or None when nothing was."""
    if context_length is None:
        return None
    room = context_length - prompt_len - 1
    if room < 1:
        raise BadRequest(
            f"the prompt is {prompt_len} tokens and the backend's context {context_length}: no room is left for a "
            "completion; nothing was forwarded"
        )
    asked = [
        value
        for field in BUDGET_FIELDS
        if isinstance(value := chat_body.get(field), int) and not isinstance(value, bool) and value > room
    ]
    if not asked:
        return None
    for field in BUDGET_FIELDS:
        value = chat_body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > room:
            chat_body[field] = room
    return {"asked": max(asked), "sent": room, "context_length": context_length}
