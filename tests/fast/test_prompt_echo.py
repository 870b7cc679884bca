"""How the proxy proves an sglang server generated from our ids without having it echo 150k ids every turn.

`input_ids` and the `prompt_token_ids` echo arrived together (sglang 0.5.13): the version decides whether the
server honours our ids, the full echo is verified on the first turn to a backend, and every turn checks the
prompt length the server counted. Each test drives a real mitmdump against the sglang replica and reads the
bodies the replica received and the bytes on disk.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.basics import tokenizer_path
from support.proxy_harness import Mitmdump, post

from tito_addon.records.record_reader import read_session_file
from tito_addon.records.trajectory_recorder import session_file_name
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread


def streamed_reply(response) -> tuple[str, str | None]:
    """The content a streamed answer carried, and the message of the error event that ended it, if one did."""
    content, error = "", None
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            error = event["error"]["message"]
        for choice in event.get("choices") or []:
            content += choice.get("delta", {}).get("content") or ""
    return content, error


def converse(proxy: Mitmdump, session: str, turns: int, stream: bool = False) -> list:
    messages: list[dict] = [{"role": "user", "content": "Weather in Paris?"}]
    statuses = []
    for turn in range(turns):
        response = post(
            proxy.url + "/v1/chat/completions",
            json={"model": "reference-model", "messages": messages, "stream": stream},
            headers={"x-session-id": session},
            timeout=30,
        )
        statuses.append(response)
        if response.status_code != 200 or (stream and streamed_reply(response)[1] is not None):
            break
        content = streamed_reply(response)[0] if stream else response.json()["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": content or ""},
                     {"role": "user", "content": f"And round {turn}?"}]  # fmt: skip
    return statuses


def run(
    tmp_path: Path,
    config: ReplicaConfig,
    options: dict[str, str] | None = None,
    turns: int = 3,
    faults=(),
    stream: bool = False,
):
    with (
        ReplicaThread(config) as replica,
        Mitmdump(
            replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec", cwd=tmp_path, options=options
        ) as proxy,
    ):
        if faults:
            replica.backend.set_faults(list(faults))
        responses = converse(proxy, "echo", turns, stream)
        return responses, replica.received(), replica.generated()


# What a turn asks of the server to echo its prompt ids: a whole turn the `prompt_token_ids`, a streamed one the input
# ids of its final sglext block (issue 42: the stream asked for them every turn, ~600 KiB at turn 200 of a Claude
# Code session, read and compared).
ECHO_FIELD = {False: "return_prompt_token_ids", True: "return_input_ids_in_sglext"}
PATHS = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])


def error_of(response, stream: bool) -> str | None:
    """The error a turn was answered with: a whole turn's status, or the error event that ended a stream."""
    if stream:
        return streamed_reply(response)[1]
    return None if response.status_code == 200 else response.json()["error"]["message"]


def recorded(tmp_path: Path):
    path = tmp_path / "rec" / session_file_name("echo")
    return read_session_file(path) if path.exists() else None


@PATHS
def test_echo_is_verified_on_the_first_turn_then_the_counted_length(tmp_path, stream) -> None:
    responses, received, _ = run(tmp_path, ReplicaConfig(tokenizer=tokenizer_path("qwen3")), turns=4, stream=stream)
    assert [r.status_code for r in responses] == [200] * 4
    assert [error_of(r, stream) for r in responses] == [None] * 4
    assert [b.get(ECHO_FIELD[stream]) for b in received] == [True, None, None, None]
    assert all(b.get("return_output_ids_in_sglext") is (True if stream else None) for b in received)
    session_file = recorded(tmp_path)
    ids = session_file.full_ids()
    assert [b["input_ids"] for b in received] == [ids[t.turn_id][0] for t in session_file.turns]


@PATHS
def test_a_server_counting_another_prompt_length_is_refused_and_nothing_is_recorded(tmp_path, stream) -> None:
    # Turn 1 is echoed and fine; turn 2 is not echoed, and the server counts one prompt token too many.
    responses, received, _ = run(
        tmp_path, ReplicaConfig(tokenizer=tokenizer_path("qwen3")), turns=3, faults=["none", "wrong_prompt_tokens"],
        stream=stream,
    )  # fmt: skip
    assert [r.status_code for r in responses] == [200, 200 if stream else 502]
    assert error_of(responses[0], stream) is None
    assert "prompt tokens" in (error_of(responses[1], stream) or "")
    assert ECHO_FIELD[stream] not in received[1]
    assert [t.turn_id for t in recorded(tmp_path).turns] == [0]


@PATHS
def test_verify_prompt_echo_checks_every_turn(tmp_path, stream) -> None:
    responses, received, _ = run(
        tmp_path,
        ReplicaConfig(tokenizer=tokenizer_path("qwen3")),
        options={"tito_verify_prompt_echo": "true"},
        turns=3,
        faults=["none", "none", "wrong_prompt_ids"],
        stream=stream,
    )
    assert [r.status_code for r in responses] == [200, 200, 200 if stream else 502]
    assert all(b.get(ECHO_FIELD[stream]) is True for b in received)
    assert "different prompt ids" in (error_of(responses[2], stream) or "")
    assert len(recorded(tmp_path).turns) == 2


def test_a_server_that_reports_no_version_echoes_every_turn(tmp_path) -> None:
    config = ReplicaConfig(tokenizer=tokenizer_path("qwen3"), report_version=False)
    responses, received, _ = run(tmp_path, config, turns=3)
    assert [r.status_code for r in responses] == [200] * 3
    assert all(b.get("return_prompt_token_ids") is True for b in received)


@pytest.mark.parametrize("report_version", [True, False])
def test_an_old_server_is_refused(tmp_path, report_version) -> None:
    """sglang < 0.5.13 ignores input_ids: refused before any generation when it says its version, and by the
    missing echo when it does not."""
    config = ReplicaConfig(tokenizer=tokenizer_path("qwen3"), honor_input_ids=False, report_version=report_version)
    responses, received, generated = run(tmp_path, config, turns=1)
    assert responses[0].status_code == 502
    assert "0.5.13" in responses[0].json()["error"]["message"]
    assert len(received) == (0 if report_version else 1)
    assert recorded(tmp_path) is None
