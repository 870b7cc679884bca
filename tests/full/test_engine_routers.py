"""The real vllm-router (PyPI, `vllm-router==0.1.17`) in front of three vLLM-shaped engines, the proxy in front of it.

With `tito_router=vllm-router` the proxy keys every backend call by its session id, so the router's sticky policies
keep each session's turns on one engine: where each turn ran is read from the engines' own logs (which engine's
generate got the turn's exact prompt ids), never from the proxy. Without the key, the router hashes each whole body,
which differs every turn, and a session's turns scatter over the engines (what issue 44 measured on main)."""

from __future__ import annotations

import threading
from pathlib import Path

import openai
import pytest
from support.basics import tokenizer_path
from support.proxy_harness import Mitmdump

from tito_addon.records.record_reader import iter_session_files
from tito_addon.replicas.fleet import VllmRouter
from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread

pytestmark = [pytest.mark.full]

SESSIONS, TURNS = 12, 3


def engines_of_sessions(tmp_path: Path, policy: str, options: dict[str, str]) -> dict[str, list[int]]:
    """Runs 12 agents (6 naming their session, 6 not) for 3 turns each through proxy -> router -> three engines;
    answers, per recorded session, the engine each of its turns ran on, in turn order."""
    configs = [VllmReplicaConfig(tokenizer=tokenizer_path("qwen3")) for _ in range(3)]
    with VllmReplicaThread(configs[0]) as e0, VllmReplicaThread(configs[1]) as e1, VllmReplicaThread(configs[2]) as e2:
        engines = [e0, e1, e2]
        with VllmRouter([e.url for e in engines], policy=policy) as router:
            settings = {"tito_backend_kind": "vllm", **options}
            record_dir = tmp_path / "rec"
            with Mitmdump(router.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
                          options=settings) as proxy:  # fmt: skip
                failures: list[BaseException] = []
                agents = [threading.Thread(target=agent, args=(proxy, n, failures)) for n in range(SESSIONS)]
                for thread in agents:
                    thread.start()
                for thread in agents:
                    thread.join(120)
                assert not failures, failures
        ran_on: dict[tuple[int, ...], list[int]] = {}
        for index, engine in enumerate(engines):
            for path, body in engine.received():
                if path.endswith("/generate"):
                    ran_on.setdefault(tuple(body["token_ids"]), []).append(index)
    placed: dict[str, list[int]] = {}
    for session in iter_session_files(record_dir):
        ids = session.full_ids()
        for turn in session.turns:
            where = ran_on.get(tuple(ids[turn.turn_id][0]), [])
            # token-exact: exactly one engine generated on exactly the recorded prompt ids
            assert len(where) == 1, (turn.session_id, turn.turn_id, where)
            placed.setdefault(turn.session_id, []).append(where[0])
    assert len(placed) == SESSIONS and all(len(turns) == TURNS for turns in placed.values()), placed
    return placed


def agent(proxy: Mitmdump, n: int, failures: list[BaseException], turns: int = TURNS) -> None:
    """Agent `n`: every other one names its session; with more turns than the default, every third streams."""
    headers = {"x-session-id": f"named-{n}"} if n % 2 == 0 else None
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-x", default_headers=headers, max_retries=0)
    messages: list[dict] = [{"role": "user", "content": f"Agent {n}: what is the weather in city number {n}?"}]
    streams = turns != TURNS and n % 3 == 0
    try:
        for turn in range(turns):
            if streams:
                with client.chat.completions.stream(model="m", messages=messages) as events:
                    for _ in events:
                        pass
                    message = events.get_final_completion().choices[0].message
            else:
                message = client.chat.completions.create(model="m", messages=messages).choices[0].message
            messages += [message.model_dump(exclude_none=True), {"role": "user", "content": f"{turn}?"}]
    except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
        failures.append(exc)


@pytest.mark.parametrize("policy", ["consistent_hash", "sticky_least_loaded"])
def test_each_session_stays_on_one_engine_behind_vllm_router(tmp_path: Path, policy: str) -> None:
    placed = engines_of_sessions(tmp_path, policy, {"tito_router": "vllm-router"})
    assert all(len(set(turns)) == 1 for turns in placed.values()), placed
    assert len({turns[0] for turns in placed.values()}) >= 2, f"the router spread no sessions: {placed}"


def test_without_the_key_a_sessions_turns_scatter(tmp_path: Path) -> None:
    placed = engines_of_sessions(tmp_path, "consistent_hash", {})
    # each follow-up lands by the hash of a body that changed: 2 of 3 engines miss, for 12 sessions x 2 follow-ups
    assert sum(len(set(turns)) > 1 for turns in placed.values()) >= SESSIONS // 2, placed


def test_an_engine_killed_mid_run_loses_no_turn_behind_vllm_router(tmp_path: Path) -> None:
    """Twelve agents (a third streaming) run four turns each through proxy -> vllm-router -> three engines; one engine
    dies while turns run on it. The router answers those turns 500 (it retries the same sticky engine): the proxy sends
    them again once the router has dropped the engine (`tito_failover_*`), a stream cut halfway goes on from its
    tokens, and no agent sees an error. Every turn is recorded once, token-exact, and its sessions continue on the
    others; where each ran is read from the engines' own logs."""
    configs = [VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"), token_delay_s=0.02) for _ in range(3)]
    with VllmReplicaThread(configs[0]) as e0, VllmReplicaThread(configs[1]) as e1, VllmReplicaThread(configs[2]) as e2:
        engines = [e0, e1, e2]
        with VllmRouter([e.url for e in engines], policy="consistent_hash") as router:
            settings = {"tito_backend_kind": "vllm", "tito_router": "vllm-router"}
            record_dir = tmp_path / "rec"
            with Mitmdump(router.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
                          options=settings) as proxy:  # fmt: skip
                failures: list[BaseException] = []
                agents = [threading.Thread(target=agent, args=(proxy, n, failures, 4)) for n in range(SESSIONS)]
                for thread in agents:
                    thread.start()
                threading.Event().wait(1.5)  # the first turns are under way, some of them on engine 0
                e0.stop()
                for thread in agents:
                    thread.join(180)
                assert not failures, failures
                log = proxy.output()
        generated: dict[tuple[int, ...], list[list[int]]] = {}
        for engine in engines:
            for entry in engine.generated():
                generated.setdefault(tuple(entry["prompt_ids"]), []).append(list(entry["completion_ids"]))
    sessions = [s for s in iter_session_files(record_dir) if s.turns]
    assert len(sessions) == SESSIONS and all(len(s.turns) == 4 for s in sessions), [len(s.turns) for s in sessions]
    failed_over = 0
    for session in sessions:
        ids = session.full_ids()
        for turn in session.turns:
            prompt = ids[turn.turn_id][0]
            if turn.resumed is None:
                # token-exact: an engine generated exactly the recorded completion on exactly the recorded prompt (a
                # turn whose generate ended before its engine died may have been derendered by another)
                assert turn.completion_ids in generated.get(tuple(prompt), []), (turn.session_id, turn.turn_id)
            else:  # a stream cut halfway: the rest was generated on the prompt and the tokens before the cut
                cut = turn.resumed.cuts[0]
                rest = generated.get(tuple(prompt + turn.completion_ids[:cut]), [])
                assert any(turn.completion_ids[cut:] == r[: len(turn.completion_ids) - cut] for r in rest), turn
            failed_over += turn.failover is not None
    assert failed_over >= 1 and "sending the call again" in log, log[-3000:]
