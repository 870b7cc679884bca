"""Transparent capture under load: 1,000 concurrent agents with no session ids anywhere (GRPO groups of 8, client
retries and mid-session edits) through one mitmdump, each request found its session and branch from the messages
alone. The full tier; the GRPO and idle-close tests are test_transparent_capture.py's, in `make test`."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest
from support.basics import tokenizer_path
from support.proxy_harness import Mitmdump
from support.transparent_agents import Agent, drive, verify


@pytest.mark.full  # 3,000 turns of 1,000 agents: a load run (make test keeps test_transparent_capture.py's)
def test_a_thousand_concurrent_agents_without_session_ids(replica, tmp_path: Path) -> None:
    """GRPO groups of 8, client retries and mid-session edits, all at once through one mitmdump."""
    replica.backend.reset()
    record_dir = tmp_path / "rec"
    rng = random.Random(7)
    plans = ["plain"] * 6 + ["retry", "edit"]
    agents = [Agent(index, index // 8, rng.choice(plans)) for index in range(1000)]
    with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path) as proxy:
        started = time.monotonic()
        asyncio.run(drive(proxy.url, agents, 3))
        elapsed = time.monotonic() - started
    stats = verify(agents, replica, record_dir)
    assert stats["sessions"] == 125
    assert stats["requests"] == 3000 + sum(a.plan in ("retry", "edit") for a in agents)
    print(f"\n1000 agents, {stats['requests']} turns in {elapsed:.1f} s ({stats['requests'] / elapsed:.0f} turns/s)")
