"""Issue 13's benchmarks: what the shared session store (Redis) costs, and how N proxies behind HAProxy scale.

    .venv/bin/python bench/run_all.py --only p1s,p2f

P1s  per-turn latency with `tito_session_store=memory` and with Redis, side by side in one run: one named session
     of N turns (each appending a ~500-token tool result) through one mitmdump against the zero-latency backend,
     plus plain mitmdump passthrough of the same requests; the median of the five turns around 2, 50, 100, 200.
P2f  turns/s of 256 agents x 10 turns (no session ids; 100 ms backend latency) through HAProxy in front of 1, 2
     and 3 processes: plain mitmdump (round-robin), the addon with `memory` (sticky: HAProxy hashes a per-agent
     header, since each process knows only its own sessions) and the addon with Redis (round-robin, no
     stickiness: any process serves any turn). Also Redis's memory per stored token after the Redis runs.
Redis runs as production would: append-only file, fsync every second.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

from concurrency import run_load
from local_servers import BackendProcess, PlainMitmdump
from p1_session import CHECKPOINTS, conversation, run_session, window

from tito_addon.records.record_reader import iter_session_files
from tito_addon.replicas.fleet import HAProxy, RedisServer
from tito_addon.replicas.proxy_process import Mitmdump


class Redis(RedisServer):
    """A throwaway redis-server (AOF, fsync every second) for one benchmark configuration."""

    def __init__(self) -> None:
        super().__init__(Path(tempfile.mkdtemp(prefix="tito-bench-redis-")), appendfsync="everysec")
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class PatientHAProxy(HAProxy):
    """The test fleet's HAProxy with production health checks: a saturated process whose accept queue is full for a
    moment is not taken out of rotation at its first slow check (the tests' `fall 1` would answer 503 then)."""

    def config(self) -> str:
        return super().config().replace("check inter 300ms fall 1 rise 1", "check inter 1s fall 3 rise 1")


class StickyHAProxy(PatientHAProxy):
    """The same HAProxy, but each agent always reaches the same process (a hash of its `x-agent-id`)."""

    def config(self) -> str:
        return super().config().replace("balance roundrobin", "balance hdr(x-agent-id)\n    hash-type consistent")


def p1_store(turns: int, repeats: int, tokenizer: str, backend_url: str) -> dict:
    """P1 with `memory` and with Redis, and the passthrough baseline, in one run."""
    requests = conversation(turns)
    runs: dict[str, list[list[float]]] = {"memory": [], "redis": [], "passthrough": []}
    redis = Redis()
    try:
        for store in ("memory", "redis"):
            record_dir = Path(tempfile.mkdtemp(prefix=f"tito-bench-p1-{store}-"))
            options = {"tito_session_store": redis.url} if store == "redis" else {}
            with Mitmdump(backend_url, tokenizer=tokenizer, record_dir=record_dir, cwd=record_dir, options=options,
                          extra_args=["--set", "flow_detail=0"]) as proxy:  # fmt: skip
                for r in range(repeats):
                    runs[store].append(run_session(proxy.url, requests, f"p1s-{store}-{r}"))
            shutil.rmtree(record_dir, ignore_errors=True)
        passthrough = PlainMitmdump(backend_url)
        try:
            for r in range(repeats):
                runs["passthrough"].append(run_session(passthrough.url, requests, f"p1s-plain-{r}"))
        finally:
            passthrough.stop()
    finally:
        redis.close()
    out: dict = {}
    for turn in (t for t in CHECKPOINTS if t <= turns):
        median = {name: statistics.median(x for run in values for x in window(run, turn)) * 1e3
                  for name, values in runs.items()}  # fmt: skip
        out[turn] = {
            "memory_ms": median["memory"], "redis_ms": median["redis"], "passthrough_ms": median["passthrough"],
            "memory_added_ms": median["memory"] - median["passthrough"],
            "redis_added_ms": median["redis"] - median["passthrough"],
            "redis_over_memory_ms": median["redis"] - median["memory"],
        }  # fmt: skip
    return out


def p2_fleet(tokenizer: str, sessions: int = 256, turns: int = 10, latency_s: float = 0.1,
             counts: tuple[int, ...] = (1, 2, 3)) -> dict:  # fmt: skip
    backend = BackendProcess(latency_s)
    result: dict = {"sessions": sessions, "turns_per_session": turns, "backend_latency_ms": latency_s * 1e3}
    redis_bytes: list[float] = []
    try:
        for n in counts:
            plain = [PlainMitmdump(backend.url) for _ in range(n)]
            try:
                with PatientHAProxy([p.url for p in plain]) as lb:
                    time.sleep(0.7)
                    result[f"passthrough_x{n}"] = run_load([lb.url], sessions, turns)
            finally:
                for proxy in plain:
                    proxy.stop()
            for store in ("memory", "redis"):
                redis = Redis() if store == "redis" else None
                record_dir = Path(tempfile.mkdtemp(prefix=f"tito-bench-p2f-{store}-"))
                options = {"tito_session_store": redis.url} if redis is not None else {}
                addons = [
                    Mitmdump(backend.url, tokenizer=tokenizer, record_dir=record_dir, cwd=record_dir, options=options,
                             extra_args=["--set", "flow_detail=0"]).start()
                    for _ in range(n)
                ]  # fmt: skip
                balancer = (PatientHAProxy if redis is not None else StickyHAProxy)([a.url for a in addons])
                try:
                    before = redis.used_memory() if redis is not None else 0
                    with balancer as lb:
                        time.sleep(0.7)
                        row = run_load([lb.url], sessions, turns)
                    sessions_on_disk = list(iter_session_files(record_dir))
                    row["recorded_turns"] = sum(len(s.turns) for s in sessions_on_disk)
                    row["sessions_on_disk"] = len(sessions_on_disk)
                    if redis is not None:
                        tokens = sum(len(t.prompt_added_ids) + len(t.completion_ids)
                                     for s in sessions_on_disk for t in s.turns)  # fmt: skip
                        for proxy in addons:  # their connections' buffers are not what the sessions cost
                            proxy.stop()
                        time.sleep(0.5)
                        used = redis.used_memory() - before
                        row["redis_bytes_per_token"] = used / tokens
                        row["redis_bytes_per_turn"] = used / row["recorded_turns"]
                        row["tokens_per_turn"] = tokens / row["recorded_turns"]
                        redis_bytes.append(row["redis_bytes_per_token"])
                    result[f"{store}_x{n}"] = row
                finally:
                    for proxy in addons:
                        proxy.stop()
                    if redis is not None:
                        redis.close()
                    shutil.rmtree(record_dir, ignore_errors=True)
            plain_rate = result[f"passthrough_x{n}"]["turns_per_s"]
            result[f"ratio_x{n}"] = {
                "memory_sticky_over_passthrough": result[f"memory_x{n}"]["turns_per_s"] / plain_rate,
                "redis_over_passthrough": result[f"redis_x{n}"]["turns_per_s"] / plain_rate,
            }
    finally:
        backend.close()
    result["redis_bytes_per_stored_token"] = statistics.median(redis_bytes) if redis_bytes else None
    return result
