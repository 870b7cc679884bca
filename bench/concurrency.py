"""P2: many concurrent agent sessions through the proxy, as a ratio to plain mitmdump on the same load.

256 agents (no session ids: sessions are found from the messages) each run 10 turns, every turn appending the
reply and a ~150-token tool result; the backend answers after a fixed latency (100 ms). The load generator is
one asyncio process; the backend runs in its own process (`local_servers.BackendProcess`) so it never competes
with the agents for the GIL.
Reported per configuration: turns/s over the whole run, and p50/p99 of per-turn latency; `measured_load` adds the
proxies' own CPU a turn, and `median_run` merges the runs of one configuration.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path

import aiohttp
import orjson

TOOL_RESULT = " ".join(f"item {i}: {i * 7919 % 10007} ok" for i in range(30))  # ~150 tokens


async def _agent(client: aiohttp.ClientSession, url: str, index: int, turns: int, latencies: list[float]) -> None:
    messages: list[dict] = [
        {"role": "system", "content": "You are a data agent."},
        {"role": "user", "content": f"Task {index}: summarise the inventory."},
    ]
    for turn in range(turns):
        body = orjson.dumps({"model": "m", "messages": messages})
        started = time.perf_counter()
        # `x-agent-id` lets a load balancer keep an agent on one process (HAProxy `balance hdr(x-agent-id)`).
        headers = {"content-type": "application/json", "x-agent-id": str(index)}
        async with client.post(url + "/v1/chat/completions", data=body, headers=headers) as response:
            data = await response.read()
            if response.status != 200:
                raise RuntimeError(f"agent {index} turn {turn}: HTTP {response.status}: {data[:300]!r}")
        latencies.append(time.perf_counter() - started)
        reply = orjson.loads(data)["choices"][0]["message"]
        messages += [{"role": "assistant", "content": reply["content"]},
                     {"role": "user", "content": f"Tool says ({turn}): {TOOL_RESULT}"}]  # fmt: skip


async def _load(urls: list[str], sessions: int, turns: int, first: int = 0) -> dict:
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        started = time.perf_counter()
        # An agent always talks to the same proxy (its session lives there), as behind a sticky load balancer.
        await asyncio.gather(
            *(_agent(client, urls[i % len(urls)], first + i, turns, latencies) for i in range(sessions))
        )
        elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "turns": len(latencies),
        "seconds": elapsed,
        "turns_per_s": len(latencies) / elapsed,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": latencies[int(0.99 * (len(latencies) - 1))] * 1e3,
    }


def run_load(urls: list[str], sessions: int, turns: int, first: int = 0) -> dict:
    """`sessions` agents numbered from `first` (agents of another number send other conversations)."""
    return asyncio.run(_load(urls, sessions, turns, first))


def warm_up(urls: list[str]) -> None:
    """32 agents x 3 turns a proxy, unmeasured, so what a process does once (its pools, its first render of each
    message shape, lazy imports) is not counted per turn. Numbered apart from the measured agents (from 0): agents
    that sent their first messages would make the measured first turns find a session they did not start."""
    run_load(urls, 32 * len(urls), 3, first=1_000_000)


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds a process has used (Linux /proc), or None where that cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def measured_load(urls: list[str], pids: list[int], sessions: int, turns: int) -> dict:
    """`run_load`, plus the proxies' own CPU per turn: on a machine whose cores the agents and the backend share,
    turns/s also moves with what they got, CPU per turn only with what the proxy did. Each proxy is warmed first:
    a short run would count what a process does once as per-turn cost, twice as often with two processes as with
    one."""
    warm_up(urls)
    before = [process_cpu_s(pid) for pid in pids]
    run = run_load(urls, sessions, turns)
    after = [process_cpu_s(pid) for pid in pids]
    used = [a - b for a, b in zip(after, before, strict=True) if a is not None and b is not None]
    if len(used) == len(pids):
        run["proxy_cpu_ms_per_turn"] = sum(used) / run["turns"] * 1e3
    return run


MEDIAN_KEYS = {"seconds", "turns_per_s", "p50_ms", "p99_ms", "proxy_cpu_ms_per_turn"}


def median_run(runs: list[dict]) -> dict:
    """The median of each measure over `runs`, with every run's turns/s kept beside it."""
    merged = {key: statistics.median(run[key] for run in runs) for key in runs[0] if key in MEDIAN_KEYS}
    merged.update({key: value for key, value in runs[0].items() if key not in MEDIAN_KEYS})
    merged["turns_per_s_runs"] = [run["turns_per_s"] for run in runs]
    if all("recorded_turns" in run for run in runs):
        merged["recorded_turns"] = [run["recorded_turns"] for run in runs]
        merged["sessions_on_disk"] = [run["sessions_on_disk"] for run in runs]
    return merged
