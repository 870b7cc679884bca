"""Streamed chunks taken in batches: whatever arrived while the consumer was busy, merged into one step.

vLLM's streaming derender is one HTTP call per generate chunk, and on the parser path each call replays all output
so far. Calling it once per chunk makes a streamed turn cost (chunks × history); calling it once per batch of the
chunks that arrived during the previous call keeps at most one call in flight, so the number of calls follows the
backend's speed, not the number of tokens. Each call also carries the parser state of all output so far, so a
batch is sent only once it has grown by a share of what was sent before (`due`): the calls of a turn are then
logarithmic in its length, and their bytes a constant times the completion's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

# Per-token lists a generate choice may carry besides its ids and logprobs (null unless asked for).
PER_TOKEN_FIELDS = ("routed_experts", "sampling_mask")
# A batch waits until it holds this share of the tokens already sent (the first goes at once: time to first byte).
GROWTH = 0.25


async def batches[T](events: AsyncIterator[T]) -> AsyncIterator[list[T]]:
    """Everything `events` yielded since the last batch (at least one item), in order; `events` keeps being read
    while the consumer works on a batch. A failure of `events` is raised after the items before it were taken.
    Closing this generator closes `events` (and with it an upstream connection)."""
    pending: list[T] = []
    ready = asyncio.Event()
    finished = False
    failure: Exception | None = None

    async def pump() -> None:
        nonlocal finished, failure
        try:
            async for item in events:
                pending.append(item)
                ready.set()
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, in order
            failure = exc
        finally:
            finished = True
            ready.set()

    task = asyncio.create_task(pump(), name="tito-chunk-pump")
    try:
        while True:
            if not pending and failure is None and not finished:
                await ready.wait()
            ready.clear()
            if pending:
                batch = pending[:]
                pending.clear()
                yield batch
            elif failure is not None:
                raise failure
            elif finished:
                return
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def merged_generate_chunk(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """One vLLM generate stream chunk standing for several consecutive ones of one choice: ids, logprob entries and
    per-token lists concatenated in order; the finish, stop reason, weight versions and usage of the last that has
    them; the prompt ids echoed by the first."""
    if len(chunks) == 1:
        return chunks[0]
    choices = [chunk["choices"][0] for chunk in chunks]
    merged = dict(choices[-1])
    merged["token_ids"] = [token for choice in choices for token in choice.get("token_ids") or []]
    if any(choice.get("logprobs") is not None for choice in choices):
        entries = [entry for choice in choices for entry in (choice.get("logprobs") or {}).get("content") or []]
        merged["logprobs"] = {**(choices[0].get("logprobs") or {}), "content": entries}
    for key in ("finish_reason", "stop_reason", "weight_versions"):
        merged[key] = next((c.get(key) for c in reversed(choices) if c.get(key) is not None), None)
    for key in PER_TOKEN_FIELDS:
        values = [choice.get(key) for choice in choices]
        if all(isinstance(value, list) for value in values):
            merged[key] = [item for value in values for item in value]
    usage = next((chunk.get("usage") for chunk in reversed(chunks) if chunk.get("usage") is not None), None)
    echoed = next(
        (chunk.get("prompt_token_ids") for chunk in chunks if chunk.get("prompt_token_ids") is not None), None
    )
    return {**chunks[-1], "choices": [merged], "usage": usage, "prompt_token_ids": echoed}


def due(waiting: list[dict[str, Any]], sent_tokens: int, growth: float = GROWTH) -> bool:
    """Whether the generate chunks waiting should be derendered now: the generation finished, or they hold at least
    `growth` times the tokens already derendered (at least one)."""
    choices = [chunk["choices"][0] for chunk in waiting]
    if any(choice.get("finish_reason") is not None for choice in choices):
        return True
    waiting_tokens = sum(len(choice.get("token_ids") or ()) for choice in choices)
    return waiting_tokens >= max(1, growth * sent_tokens)
