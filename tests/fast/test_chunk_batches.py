"""Batching streamed chunks (`backends/chunk_batches`): every item exactly once and in order, whatever the
consumer's pace; a source failure after the items before it; closing the batches closes the source; a merged vLLM
generate chunk is the concatenation of its parts."""

from __future__ import annotations

import asyncio

import pytest

from tito_addon.backends.chunk_batches import batches, merged_generate_chunk


async def source(n: int, delay: float, fail_at: int | None = None, closed: list[bool] | None = None):
    try:
        for i in range(n):
            if i == fail_at:
                raise RuntimeError("upstream broke")
            await asyncio.sleep(delay)
            yield i
    finally:
        if closed is not None:
            closed.append(True)


@pytest.mark.parametrize("consumer_delay", [0.0, 0.003, 0.02])
async def test_every_item_once_in_order_and_batches_follow_the_consumer(consumer_delay: float) -> None:
    seen: list[list[int]] = []
    async for batch in batches(source(60, 0.001)):
        seen.append(batch)
        await asyncio.sleep(consumer_delay)
    assert [i for batch in seen for i in batch] == list(range(60))
    if consumer_delay >= 0.02:
        assert len(seen) < 30 and max(map(len, seen)) > 1, [len(b) for b in seen]


async def test_a_failure_comes_after_the_items_before_it_and_closing_closes_the_source() -> None:
    got: list[int] = []
    with pytest.raises(RuntimeError, match="upstream broke"):
        async for batch in batches(source(10, 0.001, fail_at=5)):
            got += batch
    assert got == [0, 1, 2, 3, 4]
    closed: list[bool] = []
    stream = batches(source(1000, 0.001, closed=closed))
    async for _ in stream:
        break
    await stream.aclose()
    assert closed == [True], "closing the batches closed the upstream source"


def chunk(ids: list[int], finish: str | None = None, **extra) -> dict:
    choice = {"index": 0, "token_ids": ids, "finish_reason": finish, "stop_reason": None,
              "logprobs": {"content": [{"token_id": i, "logprob": -0.1 * i} for i in ids]}, **extra}  # fmt: skip
    return {"request_id": "r", "choices": [choice], "usage": None, "prompt_token_ids": None}


def test_a_merged_generate_chunk_concatenates_ids_and_logprobs_and_keeps_the_last_finish() -> None:
    first = {**chunk([1, 2]), "prompt_token_ids": [9, 9]}
    last = {**chunk([5], "stop", weight_versions=[{"version": "v", "start": 0, "end": 4}]), "usage": {"x": 1}}
    merged = merged_generate_chunk([first, chunk([3, 4]), last])
    choice = merged["choices"][0]
    assert choice["token_ids"] == [1, 2, 3, 4, 5]
    assert [e["token_id"] for e in choice["logprobs"]["content"]] == [1, 2, 3, 4, 5]
    assert choice["finish_reason"] == "stop" and choice["weight_versions"][0]["version"] == "v"
    assert merged["usage"] == {"x": 1} and merged["prompt_token_ids"] == [9, 9]
    assert merged_generate_chunk([first]) is first
