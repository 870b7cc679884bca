"""Issue 44's proof at scale: 64 agents (openai-python and Anthropic clients, id-less and named) through two proxies
that share their sessions in a real redis-server, every agent changing proxy every turn, in front of a real router
(vllm-router for vLLM engines, smg for sglang ones) and three engines. Where each turn ran is read from the engines'
own logs: follow-up turns stay on their session's engine, then one engine dies with turns in flight on it and no
agent sees an error, every turn still token-exact, its sessions going on elsewhere."""

from __future__ import annotations

import time
from pathlib import Path

import anthropic
import openai
import pytest
from support.anthropic_agent import echo as anthropic_echo
from support.basics import tokenizer_path
from support.engine_logs import engine_of, generations, run_turns
from support.proxy_harness import Mitmdump

from tito_addon.records.record_reader import iter_session_files
from tito_addon.replicas.engine_routers import SmgGateway, VllmRouter
from tito_addon.replicas.fleet import RedisServer
from tito_addon.replicas.sglang_replica import MODEL_ID as SGLANG_MODEL

pytestmark = [pytest.mark.full, pytest.mark.serial]

AGENTS = 64
MODEL = {"vllm": "m", "sglang": SGLANG_MODEL}


class Agent:
    """Agent `n`: an Anthropic client when `n` is odd, else openai-python; it names its session when `n % 4 < 2`;
    its turn `t` goes through proxy `(n + t) % 2`."""

    def __init__(self, n: int, proxies: list[Mitmdump], kind: str) -> None:
        self.n, self.proxies, self.model = n, proxies, MODEL[kind]
        self.named = n % 4 < 2
        self.messages: list[dict] = [{"role": "user", "content": f"Agent {n}: the weather in city number {n}?"}]
        self.turns = 0

    def turn(self) -> None:
        base = self.proxies[(self.n + self.turns) % 2].url + (f"/sessions/agent-{self.n}" if self.named else "")
        if self.n % 2:
            client = anthropic.Anthropic(base_url=base, api_key="sk-ant-x", max_retries=0)
            reply = client.messages.create(model=self.model, max_tokens=256, messages=self.messages)
            self.messages += [anthropic_echo(reply), {"role": "user", "content": f"And after {self.turns}?"}]
        else:
            chat = openai.OpenAI(base_url=base + "/v1", api_key="sk-x", max_retries=0)
            message = chat.chat.completions.create(model=self.model, messages=self.messages).choices[0].message
            self.messages += [message.model_dump(exclude_none=True), {"role": "user", "content": f"{self.turns}?"}]
        self.turns += 1


def engines_of_turns(engines: list, record_dir: Path) -> dict[str, list[set[int]]]:
    """Per recorded session, in turn order, the engines that generated exactly each turn's recorded completion on its
    exact prompt (a turn's generate may have ended on an engine that then died, its derender run on another)."""
    generated = generations(engines)
    placed: dict[str, list[set[int]]] = {}
    for session in iter_session_files(record_dir):
        ids = session.full_ids()
        for turn in sorted(session.turns, key=lambda t: t.turn_id):
            found = {i for i, done in generated.get(tuple(ids[turn.turn_id][0]), []) if done == turn.completion_ids}
            assert found, (turn.session_id, turn.turn_id)  # token-exact, by an engine's own log
            placed.setdefault(turn.session_id, []).append(found)
    return placed


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_64_agents_two_proxies_one_router_stay_on_their_engines_and_lose_nothing_when_one_dies(
    tmp_path: Path, kind: str
) -> None:
    record_dir = tmp_path / "rec"
    (tmp_path / "redis").mkdir()
    with (
        RedisServer(tmp_path / "redis") as redis,
        engine_of(kind, token_delay_s=0.01) as e0,
        engine_of(kind, token_delay_s=0.01) as e1,
        engine_of(kind, token_delay_s=0.01) as e2,
    ):
        engines = [e0, e1, e2]
        router = SmgGateway([e.url for e in engines]) if kind == "sglang" else VllmRouter([e.url for e in engines])
        with router:
            settings = {"tito_backend_kind": kind, "tito_router": "smg" if kind == "sglang" else "vllm-router",
                        "tito_session_store": redis.url}  # fmt: skip
            proxies = [
                Mitmdump(
                    router.url,
                    tokenizer=tokenizer_path("qwen3"),
                    record_dir=record_dir,
                    cwd=tmp_path / f"p{i}",
                    options=settings,
                )  # fmt: skip
                for i in range(2)
            ]
            for i, proxy in enumerate(proxies):
                (tmp_path / f"p{i}").mkdir()
                proxy.start()
            try:
                agents = [Agent(n, proxies, kind) for n in range(AGENTS)]
                failures: list[BaseException] = []
                for thread in run_turns(agents, 2, failures):
                    thread.join(300)
                assert not failures, failures[:3]
                before = engines_of_turns(engines, record_dir)
                assert len(before) == AGENTS and all(len(turns) == 2 for turns in before.values())
                stayed = sum(turns[1] == turns[0] and len(turns[0]) == 1 for turns in before.values())
                # follow-ups on their session's engine (at least 99 %), the sessions spread over the engines
                assert stayed >= 0.99 * AGENTS, (stayed, before)
                assert len({min(turns[0]) for turns in before.values()}) == 3, before
                # Two more turns each; engine 0 is paused a second into them (its sessions' turns then held in their
                # generation) and killed.
                threads = run_turns(agents, 2, failures)
                time.sleep(1.0)
                e0.on_loop(e0.backend.pause.pause("keep" if kind == "vllm" else "in_place"))
                time.sleep(1.0)
                e0.kill()
                for thread in threads:
                    thread.join(300)
                assert not failures, failures[:3]
            finally:
                for proxy in proxies:
                    proxy.stop()
    placed = engines_of_turns(engines, record_dir)
    assert len(placed) == AGENTS and all(len(turns) == 4 for turns in placed.values()), {
        s: len(t) for s, t in placed.items()
    }
    on_dead = [turns for turns in placed.values() if turns[0] == {0}]
    moved = [turns for turns in on_dead if 0 not in turns[-1]]
    assert moved, on_dead  # the dead engine's sessions went on elsewhere (those that ended before its death did not)
    for turns in on_dead:  # and none came back to it after leaving it
        left = next((i for i, where in enumerate(turns) if 0 not in where), len(turns))
        assert all(0 not in where for where in turns[left:]), turns
    alive = [turns for turns in placed.values() if 0 not in turns[0]]
    kept = sum(all(where == turns[0] for where in turns) for turns in alive)
    assert kept >= 0.99 * len(alive), (kept, len(alive))  # the others never left their engine
