"""The live relay's batching (`proxy/live_stream_server.ready_batches`): chunks the backend sent at once go out as one
HTTP chunk, a chunk is never held while the next one waits for the backend, every byte goes out once and in order,
and a relay closed early stops the pull in flight and closes its source."""

from __future__ import annotations

import asyncio
import random

from hypothesis import given, settings
from hypothesis import strategies as st
from support.basics import examples

from tito_addon.proxy.live_stream_server import ready_batches


async def source(parts: list[tuple[bytes, asyncio.Event | None]], closed: list[bool]):
    """Each part after its gate opens (None: at once, as the rest of one upstream read)."""
    try:
        for data, gate in parts:
            if gate is not None:
                await gate.wait()
            yield data
    finally:
        closed.append(True)


async def test_chunks_ready_together_go_out_as_one_and_a_waiting_one_holds_nothing_back() -> None:
    later = asyncio.Event()
    closed: list[bool] = []
    batches = ready_batches(source([(b"a", None), (b"b", None), (b"c", None), (b"d", later), (b"e", None)], closed))
    assert await anext(batches) == b"abc"  # out before "d" exists: nothing waits for it
    later.set()
    assert [batch async for batch in batches] == [b"de"]
    assert closed == [True]


async def test_a_relay_closed_while_the_next_chunk_is_awaited_stops_the_pull_and_closes_the_source() -> None:
    never = asyncio.Event()
    closed: list[bool] = []
    chunks = source([(b"a", None), (b"b", never)], closed)
    batches = ready_batches(chunks)
    assert await anext(batches) == b"a"
    reading = asyncio.ensure_future(anext(batches))
    await asyncio.sleep(0.01)
    assert not reading.done()
    reading.cancel()
    await asyncio.gather(reading, return_exceptions=True)
    await batches.aclose()
    await chunks.aclose()  # what the relay does next: no "already running" generator
    assert closed == [True]


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.tuples(st.binary(min_size=1, max_size=4), st.booleans()), max_size=20), st.integers(0, 2**16))
def test_every_byte_once_and_in_order_whatever_the_pace(parts: list[tuple[bytes, bool]], seed: int) -> None:
    rng = random.Random(seed)

    async def run() -> list[bytes]:
        async def paced():
            for data, waits in parts:
                if waits:
                    await asyncio.sleep(rng.choice([0, 0.0005]))
                yield data

        return [batch async for batch in ready_batches(paced())]

    batches = asyncio.run(run())
    assert b"".join(batches) == b"".join(data for data, _ in parts)
    assert all(batches)
