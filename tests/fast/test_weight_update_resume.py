"""Generations that live through weight updates: the openai SDK -> a real mitmdump -> a vLLM 0.32 replica whose engine
a "trainer" (the test) pauses mid-generation, relabels and resumes, as ../shared/docs/weight-updates.md §2 describes.

`/pause?mode=abort` ends every generation in flight with the tokens it has (`finish_reason: "abort"`); the proxy
resubmits `prompt + partial` and the agent gets one answer, the same as an uncut generation's, token for token, with
the record's ids, log-probs and per-token weight versions covering both attempts. `keep` holds the generation: nothing
is resubmitted and the spans show where the weights changed. Past the resumption cap the agent gets an error and
nothing is recorded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from support.basics import tokenizer_path
from support.proxy_harness import REPO, Mitmdump, post
from support.weight_updates import during, turns

from tito_addon.client import TitoClient
from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread

MESSAGES = [{"role": "user", "content": "Tell me about Paris."}]
TOKEN = "resume-control-token-0123456789"


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    config = VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"), token_delay_s=0.01, answer_sentences=2)
    with VllmReplicaThread(config) as replica:
        yield replica


@pytest.fixture(scope="module")
def proxy(vllm, tmp_path_factory):
    record_dir = tmp_path_factory.mktemp("rec")
    options = {"tito_backend_kind": "vllm", "tito_resume_max": "3", "tito_control_token": TOKEN}
    with Mitmdump(
        vllm.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=record_dir.parent, options=options
    ) as running:
        running.record_dir = record_dir
        yield running


@pytest.fixture
def engine(vllm):
    vllm.backend.reset()
    vllm.backend.config.weight_version = "default"
    vllm.backend.config.token_delay_s = 0.01  # a test that must cut within a few tokens samples slower
    vllm.backend.pause.stall_at = None
    yield vllm
    vllm.backend.pause.stall_at = None  # (a test that failed before its pause)
    if vllm.backend.pause.paused:
        post(vllm.url + "/resume")


def ask(proxy: Mitmdump, session: str, *, stream: bool, stop: list[str] | None = None) -> tuple[str, list[int] | None]:
    """One turn as the agent sees it: the answer's text (streamed: accumulated from the deltas)."""
    client = openai.OpenAI(
        base_url=proxy.url + "/v1", api_key="k", default_headers={"x-session-id": session}, max_retries=0, timeout=60
    )
    extra = {"stop": stop} if stop else {}
    if not stream:
        reply = client.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, **extra)
        return reply.choices[0].message.content or "", None
    text = []
    with client.chat.completions.stream(model="tiny-qwen3", messages=MESSAGES, **extra) as events:
        for event in events:
            if event.type == "content.delta":
                text.append(event.delta)
        final = events.get_final_completion()
    assert "".join(text) == final.choices[0].message.content
    return "".join(text), None


def cut_mid_generation(engine, mode: str, after_tokens: int = 12, while_paused=None) -> None:
    """The trainer's side: once a generation has sampled `after_tokens`, pause in `mode`, load "v2", resume."""
    deadline = time.monotonic() + 20
    while not any(len(g.labels) >= after_tokens for g in list(engine.backend.pause.in_flight.values())):
        assert time.monotonic() < deadline, "no generation got under way"
        time.sleep(0.005)
    assert post(engine.url + f"/pause?mode={mode}").json() == {"status": "paused"}
    assert post(engine.url + "/update_weight_version", json={"new_version": "v2"}).status_code == 200
    time.sleep(0.2)  # the update takes a while; the agent's request waits
    if while_paused is not None:
        while_paused()
    assert post(engine.url + "/resume").json() == {"status": "resumed"}


def generations_cut(proxy: Mitmdump, resuming: int | None = None) -> dict:
    """The control API's count of generations a weight update cut; with `resuming`, once that many are resuming."""
    deadline = time.monotonic() + 15
    with TitoClient(proxy.url, TOKEN) as tito:
        while True:
            counts = tito.info()["generations_cut"]
            if resuming is None or counts["resuming"] == resuming or time.monotonic() > deadline:
                return counts
            time.sleep(0.02)


def export(record_dir: Path, session: str, layout: str, tmp_path: Path, *extra: str) -> list[dict]:
    out = tmp_path / f"{layout}{len(extra)}.jsonl"
    argv = ["export", str(record_dir), str(out), "--session", session, "--format", layout, "--to", "jsonl", *extra]
    done = subprocess.run([sys.executable, "-m", "tito_addon", *argv], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


def row_logprobs(record_dir: Path, session: str, tmp_path: Path) -> list[float]:
    (row,) = export(record_dir, session, "generic", tmp_path)
    return row["rollout_logprobs"]


def show_json(record_dir: Path, session: str) -> list[dict]:
    argv = [sys.executable, "-m", "tito_addon", "show", str(record_dir), "--json"]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return [row for row in map(json.loads, done.stdout.splitlines()) if row.get("session_id") == session]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_aborted_generation_is_resumed_to_the_answer_an_uncut_one_gives(proxy, engine, stream, tmp_path) -> None:
    uncut_text, _ = ask(proxy, f"uncut-{stream}", stream=stream)
    (uncut,) = turns(proxy.record_dir, f"uncut-{stream}")
    engine.backend.reset()

    before = generations_cut(proxy)
    seen: dict = {}
    thread, out = during(ask, proxy, f"cut-{stream}", stream=stream)
    # While the engine is paused, a driver sees the cut turn waiting to be resumed; after, the update drained.
    cut_mid_generation(engine, "abort", while_paused=lambda: seen.update(paused=generations_cut(proxy, 1)))
    thread.join(60)
    assert seen["paused"]["resuming"] == 1 and seen["paused"]["cuts"] == before["cuts"] + 1
    assert generations_cut(proxy) == {"resuming": 0, "resumed": before["resumed"] + 1, "cuts": before["cuts"] + 1}
    assert "error" not in out, out.get("error")
    assert out["value"][0] == uncut_text  # the agent sees no trace of the cut

    (turn,) = turns(proxy.record_dir, f"cut-{stream}")
    assert turn.completion_ids == uncut.completion_ids and turn.completion_logprobs == uncut.completion_logprobs
    assert turn.finish_reason == uncut.finish_reason == "stop"
    # Two engine requests: the prompt, then the prompt and the partial output, exactly.
    first, second = engine.generated()
    cut = len(first["completion_ids"])
    assert 12 <= cut < len(turn.completion_ids)
    prompt = first["prompt_ids"]
    assert second["prompt_ids"] == prompt + turn.completion_ids[:cut]
    assert first["completion_ids"] + second["completion_ids"] == turn.completion_ids
    assert turn.resumed is not None and turn.resumed.attempts == 2 and turn.resumed.cuts == [cut]
    n = len(turn.completion_ids)
    assert turn.weight_version == "v2"
    assert turn.weight_version_spans == [
        {"version": "default", "start": 0, "end": cut},
        {"version": "v2", "start": cut, "end": n},
    ]
    # Exported, each sampled token carries the version that sampled it (generic: over input_ids; verl: responses).
    versions = ["default"] * cut + ["v2"] * (n - cut)
    for layout, offset in (("generic", turn.prompt_len), ("verl", 0)):
        (row,) = export(proxy.record_dir, f"cut-{stream}", layout, tmp_path)
        column = row["rollout_weight_versions"]
        assert column[offset : offset + n] == versions
        assert set(column[:offset] + column[offset + n :]) <= {""}
        bits = row["loss_mask"] if layout == "generic" else row["response_mask"]
        assert bits[offset : offset + n] == [1] * n
    # slime's own weight_versions: one per generate call, here one per attempt.
    (sample,) = export(proxy.record_dir, f"cut-{stream}", "slime", tmp_path)
    assert sample["weight_versions"] == ["default", "v2"]
    # slime's --mask-offpolicy-in-partial-rollout: the tokens sampled before the update train nothing.
    (masked,) = export(proxy.record_dir, f"cut-{stream}", "generic", tmp_path, "--mask-offpolicy")
    at = turn.prompt_len
    assert masked["loss_mask"][at : at + n] == [0] * cut + [1] * (n - cut)
    assert masked["rollout_logprobs"] == row_logprobs(proxy.record_dir, f"cut-{stream}", tmp_path)
    with TitoClient(proxy.url, TOKEN) as tito:  # the driver's view of the session
        (summary,) = tito.sessions(prefix=f"cut-{stream}")
    assert summary["resumed_turns"] == 1 and summary["attempts"] == 2
    # The drift audit says which turns were resumed, and where.
    report = tmp_path / "audit.json"
    audit = subprocess.run([sys.executable, "-m", "tito_addon", "audit", str(proxy.record_dir), "--json", str(report)],
                           cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert audit.returncode == 0, audit.stderr
    assert f"cut-{stream} turn 0: resumed after a weight update cut it at [{cut}]" in audit.stdout
    (branch,) = [b for b in json.loads(report.read_text()) if b["session_id"] == f"cut-{stream}"]
    assert branch["resumed_turns"] == {"0": [cut]}
    (shown,) = show_json(proxy.record_dir, f"cut-{stream}")
    assert shown["resumed"] == {"attempts": 2, "cuts": [cut]} and shown["weight_version"] == "v2"
    assert shown["weight_version_spans"] == turn.weight_version_spans
    # The second request's budget is the first's less what was already sampled.
    budgets = [body["sampling_params"].get("max_tokens") for path, body in engine.received() if "generate" in path]
    assert budgets[1] == (None if budgets[0] is None else budgets[0] - cut)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_kept_generation_finishes_in_one_request_with_split_spans(proxy, engine, stream) -> None:
    thread, out = during(ask, proxy, f"keep-{stream}", stream=stream)
    cut_mid_generation(engine, "keep")
    thread.join(60)
    assert "error" not in out, out.get("error")
    (turn,) = turns(proxy.record_dir, f"keep-{stream}")
    (only,) = engine.generated()
    assert only["completion_ids"] == turn.completion_ids and turn.resumed is None
    spans = turn.weight_version_spans
    assert spans is not None and [s["version"] for s in spans] == ["default", "v2"]
    assert spans[0]["start"] == 0 and spans[0]["end"] >= 12 and spans[-1]["end"] == len(turn.completion_ids)


def test_past_the_resumption_cap_the_agent_gets_an_error_and_nothing_is_recorded(proxy, engine) -> None:
    client = openai.OpenAI(
        base_url=proxy.url + "/v1", api_key="k", default_headers={"x-session-id": "capped"}, max_retries=0, timeout=60
    )

    def turn() -> None:
        client.chat.completions.create(model="tiny-qwen3", messages=MESSAGES)

    thread, out = during(turn)
    for _ in range(4):  # tito_resume_max is 3: the fourth cut is one too many
        cut_mid_generation(engine, "abort", after_tokens=2)
    thread.join(60)
    error = out.get("error")
    assert isinstance(error, openai.APIStatusError) and error.status_code == 503
    assert "tito_resume_max" in error.message
    assert turns(proxy.record_dir, "capped") == []
    assert len(engine.generated()) == 4


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_that_straddles_the_cut_ends_the_generation_there(proxy, engine, stream) -> None:
    """Each generate request checks its stop strings over its own output, so one that began before the cut and ends
    after it stops neither: the proxy finds it over the stitched ids and ends the generation where the uncut one
    stops, whole or streamed (the streamed attempt is closed there, once its spans are read)."""
    ask(proxy, f"plain-{stream}", stream=False)
    (plain,) = turns(proxy.record_dir, f"plain-{stream}")
    tok = engine.backend.tokenizer
    ids, at = plain.completion_ids, 20
    head = tok.decode(ids[: at - 3])
    # Around the cut, which falls exactly at `at`: the engine stalls there until the pause (`EnginePause.stall_at`;
    # a fixed pace raced the test thread on a loaded machine, and the cut once landed past the stop string's end).
    stop = tok.decode(ids[: at + 15])[len(head) :]
    assert tok.decode(ids).find(stop) == len(head)
    uncut_text, _ = ask(proxy, f"uncut-stop-{stream}", stream=stream, stop=[stop])
    (uncut,) = turns(proxy.record_dir, f"uncut-stop-{stream}")
    assert uncut.finish_reason == "stop" and len(uncut.completion_ids) < len(ids)
    engine.backend.reset()

    engine.backend.pause.stall_at = at  # the first request samples no further than `at` until the pause cuts it
    thread, out = during(ask, proxy, f"stop-{stream}", stream=stream, stop=[stop])
    cut_mid_generation(engine, "abort", after_tokens=at)
    thread.join(60)
    assert "error" not in out, out.get("error")
    assert out["value"][0] == uncut_text
    (turn,) = turns(proxy.record_dir, f"stop-{stream}")
    first = engine.generated()[0]
    cut = len(first["completion_ids"])
    assert cut == at and turn.resumed is not None and turn.resumed.cuts == [cut]
    assert turn.completion_ids == uncut.completion_ids and turn.finish_reason == "stop"
    assert turn.completion_logprobs == uncut.completion_logprobs
    n = len(turn.completion_ids)
    assert turn.weight_version_spans == [
        {"version": "default", "start": 0, "end": cut},
        {"version": "v2", "start": cut, "end": n},
    ]
