"""The real vllm-router (PyPI, `vllm-router==0.1.17`) in front of three vLLM-shaped engines, the proxy in front of it.

With `tito_router=vllm-router` the proxy keys every backend call by its session id, so the router's sticky policies
keep each session's turns on one engine: where each turn ran is read from the engines' own logs (which engine's
generate got the turn's exact prompt ids), never from the proxy. Without the key, the router hashes each whole body,
which differs every turn, and a session's turns scatter over the engines (what issue 44 measured on main)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import openai
import pytest
from support.basics import tokenizer_path, wait_until
from support.engine_logs import engine_of, generations, run_turns
from support.proxy_harness import Mitmdump

from tito_addon.records.record_reader import iter_session_files
from tito_addon.replicas.engine_routers import SmgGateway, VllmRouter
from tito_addon.replicas.sglang_replica import MODEL_ID as SGLANG_MODEL

pytestmark = [pytest.mark.full]

SESSIONS, TURNS = 12, 3
# The model name agents ask for: smg routes by it (a name no engine serves is its 404), vLLM's chain maps it.
MODEL = {"vllm": "m", "sglang": SGLANG_MODEL}


def router_of(name: str, engines: list, policy: str | None = None):
    """The router `name` in front of `engines`, with a sticky policy (vllm-router: consistent_hash; smg: manual)."""
    urls = [e.url for e in engines]
    if name == "smg":
        return SmgGateway(urls, policy=policy or "manual")
    return VllmRouter(urls, policy=policy or "consistent_hash")


def engines_of_sessions(
    tmp_path: Path, policy: str, options: dict[str, str], kind: str = "vllm", router_name: str = "vllm-router"
) -> dict[str, list[int]]:
    """Runs 12 agents (6 naming their session, 6 not) for 3 turns each through proxy -> router -> three engines of
    `kind`; answers, per recorded session, the engine each of its turns ran on, in turn order."""
    with engine_of(kind) as e0, engine_of(kind) as e1, engine_of(kind) as e2:
        engines = [e0, e1, e2]
        with router_of(router_name, engines, policy) as router:
            settings = {"tito_backend_kind": kind, **options}
            record_dir = tmp_path / "rec"
            with Mitmdump(router.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
                          options=settings) as proxy:  # fmt: skip
                failures: list[BaseException] = []
                agents = [
                    threading.Thread(target=agent, args=(proxy, n, failures), kwargs={"model": MODEL[kind]})
                    for n in range(SESSIONS)
                ]
                for thread in agents:
                    thread.start()
                for thread in agents:
                    thread.join(120)
                assert not failures, failures
        ran_on: dict[tuple[int, ...], list[int]] = {}
        for index, engine in enumerate(engines):
            for entry in engine.generated():  # (sglang: the chat calls that generated on input_ids)
                ran_on.setdefault(tuple(entry["prompt_ids"]), []).append(index)
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


def agent(proxy: Mitmdump, n: int, failures: list[BaseException], model: str = "m") -> None:
    """Agent `n`: every other one names its session."""
    headers = {"x-session-id": f"named-{n}"} if n % 2 == 0 else None
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-x", default_headers=headers, max_retries=0)
    messages: list[dict] = [{"role": "user", "content": f"Agent {n}: what is the weather in city number {n}?"}]
    try:
        for turn in range(TURNS):
            message = client.chat.completions.create(model=model, messages=messages).choices[0].message
            messages += [message.model_dump(exclude_none=True), {"role": "user", "content": f"{turn}?"}]
    except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
        failures.append(exc)


@pytest.mark.parametrize(
    ("router", "kind", "policy"),
    [
        ("vllm-router", "vllm", "consistent_hash"),
        ("vllm-router", "vllm", "sticky_least_loaded"),
        ("vllm-router", "sglang", "consistent_hash"),
        ("smg", "sglang", "manual"),
        ("smg", "sglang", "consistent_hashing"),
    ],
)
def test_each_session_stays_on_one_engine_behind_a_router(tmp_path: Path, router: str, kind: str, policy: str) -> None:
    """sglang behind either router: vllm-router and smg both carry sglang's chat call with our input_ids and sglext
    flags (the replica checks the ids it generates on); the engines' logs say where each turn ran."""
    placed = engines_of_sessions(tmp_path, policy, {"tito_router": router}, kind, router)
    assert all(len(set(turns)) == 1 for turns in placed.values()), placed
    assert len({turns[0] for turns in placed.values()}) >= 2, f"the router spread no sessions: {placed}"


def test_without_the_key_a_sessions_turns_scatter(tmp_path: Path) -> None:
    placed = engines_of_sessions(tmp_path, "consistent_hash", {})
    # each follow-up lands by the hash of a body that changed: 2 of 3 engines miss, for 12 sessions x 2 follow-ups
    assert sum(len(set(turns)) > 1 for turns in placed.values()) >= SESSIONS // 2, placed


class Agent:
    """Agent `n` of the kill test, turn by turn: every other one names its session; `streams`: it asks for streams."""

    def __init__(self, proxy: Mitmdump, n: int, model: str, streams: bool) -> None:
        headers = {"x-session-id": f"named-{n}"} if n % 2 == 0 else None
        self.client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-x", default_headers=headers, max_retries=0)
        self.messages: list[dict] = [{"role": "user", "content": f"Agent {n}: what is the weather in city {n}?"}]
        self.model, self.streams = model, streams

    def turn(self) -> None:
        if self.streams:
            with self.client.chat.completions.stream(model=self.model, messages=self.messages) as events:
                for _ in events:
                    pass
                message = events.get_final_completion().choices[0].message
        else:
            message = self.client.chat.completions.create(model=self.model, messages=self.messages).choices[0].message
        self.messages += [message.model_dump(exclude_none=True), {"role": "user", "content": "And then?"}]


@pytest.mark.parametrize(("router", "kind"), [("vllm-router", "vllm"), ("vllm-router", "sglang"), ("smg", "sglang")])
def test_an_engine_killed_mid_run_loses_no_turn_behind_a_router(tmp_path: Path, router: str, kind: str) -> None:
    """Twelve agents (on vLLM a third stream) run four turns each through proxy -> router -> three engines; after
    their first turns, the engine that served the most is killed with turns in flight on it. What the router hands back
    failed (a 500 where it retried the dead sticky engine; it re-routes some calls itself, depending on timing) the
    proxy sends again, a vLLM stream cut halfway goes on from its tokens, and no agent sees an error. Every turn is
    recorded once, token-exact, and the dead engine's sessions continue on the others; where each ran is read from the
    engines' own logs. (An sglang chat stream says its ids only at its end, so one cut halfway cannot go on: sglang's
    agents here ask for whole answers.)"""
    with engine_of(kind, token_delay_s=0.02) as e0, engine_of(kind, token_delay_s=0.02) as e1, \
            engine_of(kind, token_delay_s=0.02) as e2:  # fmt: skip
        engines = [e0, e1, e2]
        with router_of(router, engines) as gateway:
            settings = {"tito_backend_kind": kind, "tito_router": router}
            record_dir = tmp_path / "rec"
            with Mitmdump(gateway.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
                          options=settings) as proxy:  # fmt: skip
                failures: list[BaseException] = []
                agents = [Agent(proxy, n, MODEL[kind], kind == "vllm" and n % 3 == 0) for n in range(SESSIONS)]
                for thread in run_turns(agents, 1, failures):
                    thread.join(120)
                assert not failures, failures
                victim = max(range(3), key=lambda i: len(engines[i].generated()))
                served = len(engines[victim].generated())
                threads = run_turns(agents, 3, failures)
                # Once the next turns run on it, it is paused for a second (each of its sessions' turns is then held
                # in its generation), then killed: turns in flight die with it.
                assert wait_until(lambda: len(engines[victim].generated()) > served), "no turn ran on it"
                engines[victim].on_loop(engines[victim].backend.pause.pause("keep" if kind == "vllm" else "in_place"))
                time.sleep(1.0)
                engines[victim].kill()
                for thread in threads:
                    thread.join(180)
                assert not failures, failures
        generated = generations(engines)
    sessions = [s for s in iter_session_files(record_dir) if s.turns]
    assert len(sessions) == SESSIONS and all(len(s.turns) == 4 for s in sessions), [len(s.turns) for s in sessions]
    moved = 0
    for session in sessions:
        ids = session.full_ids()
        ran: list[set[int]] = []
        for turn in session.turns:
            prompt = ids[turn.turn_id][0]
            if turn.resumed is None:
                # token-exact: an engine generated exactly the recorded completion on exactly the recorded prompt (a
                # turn whose generate ended before its engine died may have been derendered by another)
                found = {i for i, done in generated.get(tuple(prompt), []) if done == turn.completion_ids}
            else:  # a stream cut halfway: the rest was generated on the prompt and the tokens before the cut
                cut = turn.resumed.cuts[0]
                rest = generated.get(tuple(prompt + turn.completion_ids[:cut]), [])
                found = {i for i, done in rest if turn.completion_ids[cut:] == done[: len(turn.completion_ids) - cut]}
            assert found, (turn.session_id, turn.turn_id)
            ran.append(found)
        moved += victim in ran[0] and victim not in ran[-1]
    # the dead engine's sessions (their first turn on it) went on elsewhere
    assert moved >= 1, moved


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_what_the_router_hands_back_failed_is_sent_again(tmp_path: Path, kind: str) -> None:
    """An engine answers 503 (its health check still passes): vllm-router retries that same sticky engine and hands the
    503 back. The proxy sends the call again after its backoff, and the agent gets its answer; the record says so."""
    with engine_of(kind) as e0, engine_of(kind) as e1:
        engines = [e0, e1]
        with VllmRouter([e.url for e in engines], policy="consistent_hash") as router:
            settings = {"tito_backend_kind": kind, "tito_router": "vllm-router", "tito_failover_backoff_ms": "300"}
            record_dir = tmp_path / "rec"
            with Mitmdump(router.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
                          options=settings) as proxy:  # fmt: skip
                client = openai.OpenAI(base_url=proxy.url + "/sessions/s503/v1", api_key="sk-x", max_retries=0)
                messages: list[dict] = [{"role": "user", "content": "Weather in Paris?"}]
                reply = client.chat.completions.create(model="m", messages=messages)
                (home,) = [e for e in engines if e.generated()]
                # more 503s than the router's own attempts (5) and fewer than its circuit breaker's threshold (10)
                home.set_faults(["generate:http503" if kind == "vllm" else "http503"] * 8)
                messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "?"}]
                second = client.chat.completions.create(model="m", messages=messages)
                assert second.choices[0].message.content or second.choices[0].message.tool_calls
    (session,) = [s for s in iter_session_files(record_dir) if s.turns]
    turn = session.turns[1]
    assert turn.failover is not None and turn.failover.retries >= 1, turn.failover
    assert all("answered 503" in error for error in turn.failover.errors), turn.failover
    assert turn.completion_ids in [entry["completion_ids"] for entry in home.generated()]


@pytest.mark.parametrize(("router", "kind"), [("vllm-router", "vllm"), ("smg", "sglang")])
def test_an_engine_added_takes_new_sessions_and_one_removed_drains(tmp_path: Path, router: str, kind: str) -> None:
    """Engines come and go through the router's own API (vllm-router: /add_worker, /remove_worker; smg: /workers):
    one added mid-run takes new sessions, one removed gets no turn after it left while its sessions go on elsewhere;
    the proxy is not told and nothing breaks. Where each turn ran is read from the engines' own logs."""
    with engine_of(kind) as e0, engine_of(kind) as e1, engine_of(kind) as e2:
        with router_of(router, [e0, e1]) as gateway:
            settings = {"tito_backend_kind": kind, "tito_router": router}
            with Mitmdump(gateway.url, tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec", cwd=tmp_path,
                          options=settings) as proxy:  # fmt: skip
                histories: dict[str, list[dict]] = {}

                def turn(session: str) -> None:
                    client = openai.OpenAI(
                        base_url=proxy.url + f"/sessions/{session}/v1", api_key="sk-x", max_retries=0
                    )
                    messages = histories.setdefault(session, [{"role": "user", "content": f"Weather for {session}?"}])
                    reply = client.chat.completions.create(model=MODEL[kind], messages=messages)
                    messages += [
                        reply.choices[0].message.model_dump(exclude_none=True),
                        {"role": "user", "content": "?"},
                    ]

                for n in range(6):
                    turn(f"early-{n}")
                assert not e2.generated()
                gateway.add_engine(e2.url)
                for n in range(24):  # new sessions until one lands on the added engine (each misses it 1 time in 3)
                    turn(f"late-{n}")
                    if e2.generated():
                        break
                assert e2.generated(), "no new session went to the added engine"
                gateway.remove_engine(e0.url)
                before = len(e0.generated())
                for session in list(histories):
                    turn(session)
                assert len(e0.generated()) == before  # removed: no generation on it since
    sessions = {f.turns[0].session_id: f for f in iter_session_files(tmp_path / "rec") if f.turns}
    assert all(len(f.turns) == 2 for f in sessions.values()), {s: len(f.turns) for s, f in sessions.items()}


def test_bad_cases_behind_the_router_are_clear_errors_and_record_nothing(tmp_path: Path) -> None:
    """The router down, every engine behind it down, an engine answering 200 with a body of another kind: each reaches
    the agent as an error in its own API (openai-python's and Anthropic's exceptions) after the bounded retries where
    a retry can help, and nothing is recorded."""
    import anthropic

    with engine_of("vllm") as e0, engine_of("vllm") as e1:
        router = VllmRouter([e0.url, e1.url])
        router.start()
        settings = {"tito_backend_kind": "vllm", "tito_router": "vllm-router", "tito_failover_backoff_ms": "100"}
        record_dir = tmp_path / "rec"
        try:
            with Mitmdump(router.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
                          options=settings) as proxy:  # fmt: skip
                chat = openai.OpenAI(base_url=proxy.url + "/sessions/bad/v1", api_key="sk-x", max_retries=0)
                claude = anthropic.Anthropic(base_url=proxy.url + "/sessions/bad", api_key="sk-x", max_retries=0)
                question = [{"role": "user", "content": "Weather?"}]
                chat.chat.completions.create(model="m", messages=question)  # the facts are known; one turn recorded
                # an engine that answers 200 with a body of another kind: no retry can mend it
                for engine in (e0, e1):
                    engine.set_faults(["derender:not_chat"])
                with pytest.raises(openai.APIStatusError) as bad_body:
                    chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "Other?"}])
                assert bad_body.value.status_code == 502 and "without a message" in str(bad_body.value)
                # every engine down behind a live router: its 5xx, after the retries
                e0.kill()
                e1.kill()
                began = time.monotonic()
                with pytest.raises(anthropic.APIStatusError) as all_down:
                    claude.messages.create(model="m", max_tokens=32, messages=[{"role": "user", "content": "Rain?"}])
                assert all_down.value.status_code >= 500 and time.monotonic() - began >= 0.1 + 0.2 + 0.4
                # the router itself down
                router.stop()
                with pytest.raises(openai.APIStatusError) as no_router:
                    chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "Snow?"}])
                assert no_router.value.status_code == 502 and "unreachable" in str(no_router.value)
                log = proxy.output()
        finally:
            router.stop()
    (session,) = [f for f in iter_session_files(record_dir) if f.turns]
    assert len(session.turns) == 1  # only the first turn: nothing of the failed ones
    assert log.count("sending the call again") >= 6, log[-3000:]
