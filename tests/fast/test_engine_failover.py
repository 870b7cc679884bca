"""Lossless failover (`tito_engines`, `tito_failover_*`): a session stays on the engine its id hashes to, and a turn
whose engine dies (refused, 5xx, reset, a stream cut halfway) completes on another with the same prompt ids; the agent
never sees the death. Where each turn ran is read from the engines' own received bodies, never from the proxy. The real
vllm-router in front of engines that die is tests/full/test_engine_routers.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from support.basics import tokenizer_path
from support.engine_logs import engine_of
from support.proxy_harness import Mitmdump, post

from tito_addon.client import TitoClient
from tito_addon.records.record_reader import iter_session_files

QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


def question(session: str) -> list[dict]:
    """A first message of the session's own: where a turn ran is found by its prompt ids."""
    return [{"role": "user", "content": f"Weather in Paris for {session}?"}]


@contextlib.contextmanager
def engines_and_proxy(
    kind: str, root: Path, count: int = 3, configs=None, **options
) -> Iterator[tuple[list, Mitmdump]]:
    configs = configs or [{}] * count
    with contextlib.ExitStack() as stack:
        engines = [stack.enter_context(engine_of(kind, **config)) for config in configs]
        settings = {"tito_backend_kind": kind, "tito_engines": ",".join(e.url for e in engines), **options}
        proxy = stack.enter_context(
            Mitmdump(
                engines[0].url, tokenizer=tokenizer_path("qwen3"), record_dir=root / "rec", cwd=root, options=settings
            )  # fmt: skip
        )
        yield engines, proxy


def generated_prompts(engine) -> list[tuple[int, ...]]:
    """The prompt ids of every generation the engine ran (a request its fault refused is not one)."""
    return [tuple(entry["prompt_ids"]) for entry in engine.generated()]


def where_each_turn_ran(engines: list, record_dir: Path) -> dict[tuple[str, int], list[int]]:
    """(session, turn) -> the engines whose generation got exactly that turn's recorded prompt ids."""
    ran_on: dict[tuple[int, ...], list[int]] = {}
    for index, engine in enumerate(engines):
        for prompt in generated_prompts(engine):
            ran_on.setdefault(prompt, []).append(index)
    placed = {}
    for session in iter_session_files(record_dir):
        ids = session.full_ids()
        for turn in session.turns:
            placed[(turn.session_id, turn.turn_id)] = ran_on.get(tuple(ids[turn.turn_id][0]), [])
    return placed


def turns_of(record_dir: Path, session: str):
    (found,) = [f for f in iter_session_files(record_dir) if f.turns and f.turns[0].session_id == session]
    return found.turns


def chat(client: openai.OpenAI, messages: list, *, stream: bool) -> dict:
    if stream:
        with client.chat.completions.stream(model="m", messages=messages) as events:
            for _ in events:
                pass
            return events.get_final_completion().choices[0].message.model_dump(exclude_none=True)
    return client.chat.completions.create(model="m", messages=messages).choices[0].message.model_dump(exclude_none=True)


def agent(proxy: Mitmdump, session: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + f"/sessions/{session}/v1", api_key="sk-x", max_retries=0)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_each_session_stays_on_the_engine_its_id_hashes_to_and_moves_when_it_dies(tmp_path: Path, kind: str) -> None:
    with engines_and_proxy(kind, tmp_path) as (engines, proxy):
        sessions = [f"s{n}-{kind}" for n in range(9)]
        histories = {s: question(s) for s in sessions}
        for session in sessions:
            for _ in range(2):
                histories[session] += [chat(agent(proxy, session), histories[session], stream=False),
                                       {"role": "user", "content": "And tomorrow?"}]  # fmt: skip
        placed = where_each_turn_ran(engines, proxy.record_dir)
        home = {}
        for session in sessions:
            runs = [placed[(session, 0)], placed[(session, 1)]]
            # token-exact, on one engine, and that engine is the one the record names
            assert all(len(r) == 1 for r in runs) and runs[0] == runs[1], (session, runs)
            home[session] = runs[0][0]
            assert {t.engine for t in turns_of(proxy.record_dir, session)} == {engines[home[session]].url}
        assert len(set(home.values())) >= 2, home  # spread over the engines
        dead = home[sessions[0]]
        engines[dead].stop()
        for session in sessions:  # every session's third turn: those of the dead engine move, no agent sees it
            histories[session] += [chat(agent(proxy, session), histories[session], stream=False)]
    placed = where_each_turn_ran(engines, proxy.record_dir)
    for session in sessions:
        (third,) = placed[(session, 2)]
        last = turns_of(proxy.record_dir, session)[-1]
        assert last.parent_turn_id == 1 and last.engine == engines[third].url
        if home[session] == dead:
            # the first turn to find it dead failed over; later ones of its sessions went to their next engine at once
            assert third != dead, (session, third)
            assert (last.failover is not None) == (session == sessions[0]), (session, last.failover)
        else:
            assert third == home[session] and last.failover is None, (session, third, home[session])


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
@pytest.mark.parametrize("fault", ["http503", "http500", "reset_early"])
def test_a_turn_the_engine_fails_is_sent_again_whole_to_the_next_engine(tmp_path: Path, kind: str, fault: str) -> None:
    with engines_and_proxy(kind, tmp_path, count=2) as (engines, proxy):
        session = f"f-{kind}-{fault}"
        first = chat(agent(proxy, session), list(QUESTION), stream=False)
        home = where_each_turn_ran(engines, proxy.record_dir)[(session, 0)][0]
        step = "generate:" if kind == "vllm" else ""
        engines[home].set_faults([step + fault])
        messages = [*QUESTION, first, {"role": "user", "content": "And tomorrow?"}]
        second = chat(agent(proxy, session), messages, stream=False)
        assert second.get("content") or second.get("tool_calls")
    placed = where_each_turn_ran(engines, proxy.record_dir)
    assert placed[(session, 1)] == [1 - home]  # exactly once, on the other engine, on the recorded prompt ids
    turn = turns_of(proxy.record_dir, session)[1]
    assert turn.engine == engines[1 - home].url and turn.failover is not None and turn.failover.retries == 1
    assert turn.parent_turn_id == 0 and turn.resumed is None


def test_a_stream_cut_halfway_goes_on_from_its_tokens_on_another_engine(tmp_path: Path) -> None:
    """The agent was streamed half a generation when its engine died: the generation goes on from exactly those ids on
    the other engine, and what the agent read is what is recorded, one generation of two engine requests."""
    configs = [{"answer_sentences": 3}, {"answer_sentences": 3}]
    with engines_and_proxy("vllm", tmp_path, configs=configs) as (engines, proxy):
        session = "cut-stream"
        chat(agent(proxy, session), list(QUESTION), stream=False)
        home = where_each_turn_ran(engines, proxy.record_dir)[(session, 0)][0]
        engines[home].set_faults(["generate:cut_stream"])
        turns = turns_of(proxy.record_dir, session)
        messages = [*QUESTION, turns[0].assistant_message, {"role": "user", "content": "And tomorrow?"}]
        texts = []
        with agent(proxy, session).chat.completions.stream(model="m", messages=messages) as events:
            for event in events:
                if event.type == "content.delta":
                    texts.append(event.delta)
            final = events.get_final_completion().choices[0].message
    turn = turns_of(proxy.record_dir, session)[1]
    assert "".join(texts) == final.content == turn.assistant_message.get("content")
    assert (
        turn.resumed is not None and turn.resumed.attempts == 2 and 0 < turn.resumed.cuts[0] < len(turn.completion_ids)
    )
    assert turn.failover is not None and turn.failover.retries == 1 and turn.engine == engines[1 - home].url
    # the other engine generated on the prompt and the cut attempt's tokens, exactly as recorded
    (session_file,) = [f for f in iter_session_files(proxy.record_dir) if f.turns[0].session_id == session]
    prompt = list(session_file.full_ids()[1][0])
    resumed_on = prompt + turn.completion_ids[: turn.resumed.cuts[0]]
    assert tuple(resumed_on) in generated_prompts(engines[1 - home])
    assert tuple(prompt) in generated_prompts(engines[home])


def test_the_control_api_says_which_engines_a_call_found_dead(tmp_path: Path) -> None:
    with engines_and_proxy("vllm", tmp_path, count=2, tito_control_token="token-of-the-engines-test") as (
        engines,
        proxy,
    ):
        with TitoClient(proxy.url, "token-of-the-engines-test") as tito:
            assert tito.info()["engines"] == {"urls": [e.url for e in engines], "down": []}
            session = "seen-dead"
            chat(agent(proxy, session), question(session), stream=False)
            home = where_each_turn_ran(engines, proxy.record_dir)[(session, 0)][0]
            engines[home].stop()
            chat(agent(proxy, session), question(session), stream=False)
            info = tito.info()
    assert info["router"] == "none" and info["engines"]["down"] == [engines[home].url]


def test_a_turn_on_other_weights_than_its_parent_is_flagged(tmp_path: Path) -> None:
    configs = [{"weight_version": "step-7"}, {"weight_version": "step-8"}]
    with engines_and_proxy("vllm", tmp_path, configs=configs) as (engines, proxy):
        session = "weights"
        first = chat(agent(proxy, session), list(QUESTION), stream=False)
        home = where_each_turn_ran(engines, proxy.record_dir)[(session, 0)][0]
        engines[home].stop()
        chat(agent(proxy, session), [*QUESTION, first, {"role": "user", "content": "And tomorrow?"}], stream=False)
    parent, child = turns_of(proxy.record_dir, session)
    assert parent.weight_version == configs[home]["weight_version"] and parent.parent_weight_version is None
    assert child.weight_version == configs[1 - home]["weight_version"]
    assert child.parent_weight_version == parent.weight_version


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_every_engine_down_is_a_clear_error_after_the_retries_and_nothing_is_recorded(
    tmp_path: Path, kind: str
) -> None:
    with engines_and_proxy(kind, tmp_path, count=2, tito_failover_backoff_ms="50") as (engines, proxy):
        chat(agent(proxy, "warm"), list(QUESTION), stream=False)  # the engines' facts are known
        for engine in engines:
            engine.stop()
        reply = post(proxy.url + "/sessions/down/v1/chat/completions", json={"model": "m", "messages": QUESTION})
        assert reply.status_code == 502, reply.text
        assert (
            reply.json()["error"]["type"] == "upstream_unavailable"
            and "unreachable" in reply.json()["error"]["message"]
        )
        log = proxy.output()
    assert not [f for f in iter_session_files(proxy.record_dir) if f.turns and f.turns[0].session_id == "down"]
    assert log.count("sending the call again") >= 3, log[-3000:]


def test_without_failover_a_dead_engine_is_answered_at_once(tmp_path: Path) -> None:
    with engines_and_proxy("vllm", tmp_path, count=2, tito_failover_retries="0") as (engines, proxy):
        session = "no-failover"
        chat(agent(proxy, session), list(QUESTION), stream=False)
        home = where_each_turn_ran(engines, proxy.record_dir)[(session, 0)][0]
        engines[home].set_faults(["generate:http503"])
        reply = post(proxy.url + f"/sessions/{session}/v1/chat/completions", json={"model": "m", "messages": QUESTION})
        assert reply.status_code == 503, reply.text
    assert len(turns_of(proxy.record_dir, session)) == 1


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"tito_engines": "http://127.0.0.1:9,http://127.0.0.1:10", "tito_router": "vllm-router"}, "tito_engines"),
        (
            {"tito_engines": "http://127.0.0.1:9", "tito_backend_url": "http://127.0.0.1:11"},
            "replaces tito_backend_url",
        ),
        ({"tito_failover_retries": "-2"}, "failover_retries"),
    ],
)
def test_settings_that_cannot_be_served_refuse_to_start(tmp_path: Path, options: dict, said: str) -> None:
    proxy = Mitmdump("http://127.0.0.1:9", tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec",
                     cwd=tmp_path, options=options)  # fmt: skip
    returncode, output = proxy.run_to_exit()
    assert returncode != 0 and said in output, output[-3000:]
