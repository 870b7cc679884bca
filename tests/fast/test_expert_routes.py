"""Mixture-of-experts routes (`tito_routed_experts`): the openai SDK -> a real mitmdump -> a replica started with
`--enable-return-routed-experts` (sglang 0.5.23's chat with `input_ids`, vLLM 0.32's and 0.24's generate), whose routes
are a known function of each token and its position (`replicas/expert_routing`), so every recorded and exported row
can be checked against what the engine computed, position for position.

Each turn asks only from where its parents' routes end (sglang `routed_experts_start_len`, vLLM
`sampling_params.routed_experts_prompt_start`), keeps those rows in its session's side file, and the record stitches a
turn's whole sequence from its chain; a generation resumed across a weight update keeps each attempt's rows; a backend
that answers none records the gap, and the next turn asks again from where the routes end.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import time
from pathlib import Path

import numpy as np
import openai
import pytest
from support.basics import tokenizer_path
from support.chat_agent import take_turn
from support.proxy_harness import Mitmdump, post
from support.tito_commands import redrive, run_cli
from support.weight_updates import during

from tito_addon.backends.expert_routes import RoutesAsked, RouteShape, RoutesRead, read_sglang, read_vllm
from tito_addon.records.record_reader import read_session
from tito_addon.records.recorded_routes import sequence_routes
from tito_addon.records.trainer_rows import encode_rows, session_rows
from tito_addon.records.trajectory_recorder import routes_file_name, session_file_name
from tito_addon.replicas.expert_routing import expert_routes
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread
from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread
from tito_addon.tito_errors import UpstreamMalformed

BACKENDS = ["sglang-0.5.23", "vllm-0.32.0", "vllm-0.24.0"]
LAYERS, TOPK, EXPERTS = 3, 2, 8
MOE = {"routed_experts": True, "moe_layers": LAYERS, "moe_topk": TOPK, "moe_experts": EXPERTS, "answer_sentences": 1}


class Stack:
    def __init__(self, name: str, replica, proxy: Mitmdump, record_dir: Path) -> None:
        self.kind, self.version = name.split("-")
        self.replica, self.proxy, self.record_dir = replica, proxy, record_dir
        self.model = "tiny-qwen3" if self.kind == "vllm" else "reference-model"

    def client(self, session: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.proxy.url + "/v1", api_key="k", default_headers={"x-session-id": session}, max_retries=0,
            timeout=60,
        )  # fmt: skip


@pytest.fixture(scope="module", params=BACKENDS)
def stack(request, tmp_path_factory):
    kind, version = request.param.split("-")
    record_dir = tmp_path_factory.mktemp(f"rec-{request.param}")
    options = {"tito_routed_experts": "true", "tito_routed_experts_shape": f"{LAYERS}x{TOPK}", "tito_resume_max": "3"}
    if kind == "vllm":
        replica = VllmReplicaThread(VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"), version=version, **MOE))
        options["tito_backend_kind"] = "vllm"
    else:
        replica = ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"), version=version, **MOE))
    settings = {"tokenizer": tokenizer_path("qwen3"), "record_dir": record_dir, "options": options}
    with replica, Mitmdump(replica.url, cwd=record_dir.parent, **settings) as proxy:
        yield Stack(request.param, replica, proxy, record_dir)


@pytest.fixture
def engine(stack):
    config = stack.replica.backend.config
    yield stack
    config.routed_experts, config.token_delay_s, config.weight_version = True, 0.0, "default"


def converse(stack: Stack, session: str, streams: list[bool], messages: list[dict] | None = None) -> list[dict]:
    """A chained tool-calling conversation (on from `messages`), turn i streamed where `streams[i]`: its messages."""
    client = stack.client(session)
    messages = messages if messages is not None else [{"role": "user", "content": "Weather in Paris?"}]
    for turn, stream in enumerate(streams):
        take_turn(client, messages, model=stack.model, stream=stream, result=f"{20 + turn}C and sunny")
    return messages


def engine_routes(ids: list[int]) -> np.ndarray:
    """What the engine computed for a sequence: a route for every position but the last."""
    return expert_routes(ids, 0, len(ids) - 1, LAYERS, TOPK, EXPERTS)


def assert_aligned(routes: np.ndarray, ids: list[int]) -> None:
    assert routes.shape == (len(ids) - 1, LAYERS, TOPK)
    assert np.array_equal(routes, engine_routes(ids))


def test_each_token_is_routed_once_and_the_record_stitches_every_turns_sequence(stack) -> None:
    session = f"routes-{stack.kind}-{stack.version}"
    converse(stack, session, [False, True, False, True])
    recorded = read_session(stack.record_dir, session)
    assert recorded is not None
    ids = recorded.full_ids()
    through = 0
    for turn in recorded.turns:
        prompt, completion = ids[turn.turn_id]
        ref = turn.routed_experts
        assert ref is not None and ref.missing is None
        # Asked from where the parent's routes end: only the positions no earlier turn routed.
        assert ref.start == through and ref.end == len(prompt) + len(completion) - 1
        assert (ref.layers, ref.topk, ref.dtype) == (LAYERS, TOPK, "uint8")
        through = turn.routed_experts_through
        assert through == ref.end
        routes = sequence_routes(recorded, turn.turn_id)
        assert routes is not None and routes.complete and not routes.missing
        assert_aligned(routes.array, prompt + completion)
    # One byte an expert: the side file holds each position's route once.
    side = stack.record_dir / routes_file_name(session_file_name(session))
    assert side.stat().st_size == through * LAYERS * TOPK


def test_exported_routes_align_with_the_exported_ids_in_every_layout(stack, tmp_path) -> None:
    session = f"export-{stack.kind}-{stack.version}"
    converse(stack, session, [False, False, True])
    recorded = read_session(stack.record_dir, session)
    assert recorded is not None
    (generic,) = session_rows(recorded, "generic")
    (verl,) = session_rows(recorded, "verl")
    (slime,) = session_rows(recorded, "slime")
    routes = np.load(io.BytesIO(generic["routed_experts"]))
    assert generic["routed_experts_missing"] is None
    assert_aligned(routes, generic["input_ids"])
    with pytest.raises(AssertionError):  # one position off is not the engine's routing
        assert_aligned(np.roll(routes, 1, axis=0), generic["input_ids"])
    assert verl["routed_experts"] == generic["routed_experts"] and verl["input_ids"] == generic["input_ids"]
    assert slime["rollout_routed_experts"] == generic["routed_experts"] and slime["tokens"] == generic["input_ids"]
    # `show --json` says where each turn's routes are and how far its chain reaches.
    shown = [json.loads(line) for line in run_cli("show", str(stack.record_dir), "--session", session, "--json")
             .stdout.splitlines()]  # fmt: skip
    assert [(row["routed_experts"]["start"], row["routed_experts_through"]) for row in shown] == [
        (turn.routed_experts.start, turn.routed_experts_through) for turn in recorded.turns
    ]
    assert all(row["routed_experts"]["file"].endswith(".routes") for row in shown)
    # JSON Lines carries the same .npy file as base64 text, as vLLM sends routes.
    line = encode_rows([generic], "generic", "jsonl").decode()
    text = line.split('"routed_experts": "')[1].split('"')[0]
    assert base64.b64decode(text) == generic["routed_experts"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_turn_without_routes_records_the_gap_and_the_next_asks_from_where_they_end(engine, stream) -> None:
    stack = engine
    session = f"gap-{stack.kind}-{stack.version}-{stream}"
    messages = converse(stack, session, [False])
    stack.replica.backend.config.routed_experts = False  # an engine started without the flag: it answers none
    messages = converse(stack, session, [stream], messages)
    stack.replica.backend.config.routed_experts = True
    converse(stack, session, [False], messages)
    recorded = read_session(stack.record_dir, session)
    assert recorded is not None
    first, gap, after = recorded.turns
    # (vLLM 0.24 is never streamed live: its stream is re-framed from a whole turn)
    live_vllm_stream = stream and stack.kind == "vllm" and stack.version != "0.24.0"
    said = (
        "vLLM's generate stream carried no routed experts"
        if live_vllm_stream
        else "the backend returned no routed experts"
    )
    assert gap.routed_experts is not None and gap.routed_experts.rows == 0 and gap.routed_experts.missing == said
    assert gap.routed_experts_through == gap.routed_experts.start == first.routed_experts_through
    routes = sequence_routes(recorded, gap.turn_id)
    assert routes is not None and not routes.complete and routes.through == first.routed_experts_through
    assert routes.missing == [f"turn {gap.turn_id}: {said}"]
    # Exported as the leaf of its segment, its row has no routes and says why.
    (row,) = session_rows(dataclasses.replace(recorded, turns=[first, gap]), "generic")
    assert row["routed_experts"] is None
    assert (
        row["routed_experts_missing"]
        == f"routes of {routes.through} of {routes.positions} positions: {routes.missing[0]}"
    )
    # The next turn asks from where the chain's routes end, so its sequence is whole again.
    assert after.routed_experts is not None and after.routed_experts.start == first.routed_experts_through
    prompt, completion = recorded.full_ids()[after.turn_id]
    whole = sequence_routes(recorded, after.turn_id)
    assert whole is not None and whole.complete
    assert_aligned(whole.array, prompt + completion)


def cut_and_resume(stack: Stack, after_tokens: int = 6) -> None:
    """The trainer's side: once a generation has sampled `after_tokens`, an abort-mode pause, weights "v2", resume."""
    engine = stack.replica
    deadline = time.monotonic() + 20
    while not any(len(g.labels) >= after_tokens for g in list(engine.backend.pause.in_flight.values())):
        assert time.monotonic() < deadline, "no generation got under way"
        time.sleep(0.005)
    if stack.kind == "vllm":
        assert post(engine.url + "/pause?mode=abort").json() == {"status": "paused"}
    else:
        assert post(engine.url + "/pause_generation", json={"mode": "abort"}).json()["status"] == "ok"
    assert post(engine.url + "/update_weight_version", json={"new_version": "v2"}).status_code == 200
    time.sleep(0.1)
    assert post(engine.url + ("/resume" if stack.kind == "vllm" else "/continue_generation")).status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_generation_resumed_across_a_weight_update_keeps_each_attempts_routes(engine, stream, tmp_path) -> None:
    stack = engine
    session = f"resumed-{stack.kind}-{stack.version}-{stream}"
    messages = converse(stack, session, [False])  # a parent, so the cut turn asks from past its prompt's start
    stack.replica.backend.config.token_delay_s = 0.01
    thread, out = during(converse, stack, session, [stream], messages)
    cut_and_resume(stack)
    thread.join(60)
    assert "error" not in out, out.get("error")
    recorded = read_session(stack.record_dir, session)
    assert recorded is not None
    parent, cut = recorded.turns
    assert cut.resumed is not None and len(cut.resumed.cuts) == 1
    ref = cut.routed_experts
    assert ref is not None and ref.missing is None and ref.start == parent.routed_experts_through
    # The second attempt's rows begin where the first's ended: the last token it sampled, fed forward after the cut.
    assert ref.attempts == [cut.prompt_len + cut.resumed.cuts[0] - 1]
    prompt, completion = recorded.full_ids()[cut.turn_id]
    routes = sequence_routes(recorded, cut.turn_id)
    assert routes is not None and routes.complete
    assert_aligned(routes.array, prompt + completion)
    if stack.kind == "vllm" and stack.version == "0.24.0":
        return  # 0.24 reports no weight versions
    # Each row's weights: the first attempt's before the cut (a live sglang stream reports none), the update's after.
    first = "" if stack.kind == "sglang" and stream else "default"
    assert routes.versions[ref.start] == first and routes.versions[-1] == "v2"
    if stack.kind == "sglang" and not stream:
        # Re-drive and the audit say which weights routed the sequence: replayed under others, another model's routing.
        report = redrive(stack.record_dir, stack.replica.url, tmp_path / "redrive.json")
        (scored,) = [t for t in report["turns"] if t["session_id"] == session and t["turn_id"] == cut.turn_id]
        assert scored["routes"]["weight_versions"] == ["default", "v2"] and scored["routes"]["complete"]
        out = tmp_path / "audit.json"
        audit = run_cli("audit", str(stack.record_dir), "--session", session, "--json", str(out))
        assert (
            f"turn {cut.turn_id}: MoE routes of {routes.through} of {routes.positions} positions, under weights "
            "default, v2" in audit.stdout
        )
        (branch,) = json.loads(out.read_text())
        assert branch["routes"]["weight_versions"] == ["default", "v2"]


def npy_text(array: np.ndarray) -> str:
    sink = io.BytesIO()
    np.save(sink, array, allow_pickle=False)
    return base64.b64encode(sink.getvalue()).decode()


def int32_text(array: np.ndarray) -> str:
    return base64.b64encode(array.astype("<i4").tobytes()).decode()


def test_an_answer_is_laid_on_the_positions_asked_or_refused_never_shifted() -> None:
    """The readers of both engines' encodings: rows for exactly the positions asked; an engine that answered from 0
    has the asked ones cut out; any other count is a gap said in words; what is not routes at all is the backend's
    fault (a 502, nothing recorded)."""
    ids = list(range(100, 120))
    whole = engine_routes(ids)  # 19 rows: every position but the last
    shape = RouteShape(LAYERS, TOPK)
    asked = RoutesAsked(5, shape)
    for read, text_of in [
        (read_vllm, npy_text),
        (read_sglang, lambda a: base64.b64encode(a.astype("<i4").tobytes()).decode()),
    ]:
        found = read(text_of(whole[5:]), asked, 14)
        assert found.rows is not None and found.rows.start == 5 and np.array_equal(found.rows.array, whole[5:])
        assert found.rows.array.dtype == np.uint8
        from_zero = read(text_of(whole), asked, 14)
        assert from_zero.rows is not None and np.array_equal(from_zero.rows.array, whole[5:])
        short = read(text_of(whole[5:-1]), asked, 14)
        assert (
            short.rows is None and short.missing == "the backend returned 13 rows of routes for the 14 positions asked"
        )
        assert read(None, asked, 14) == RoutesRead(None, "the backend returned no routed experts")
        with pytest.raises(UpstreamMalformed):
            read("not base64!", asked, 14)
        with pytest.raises(UpstreamMalformed):
            read(text_of(-whole[5:] - 1), asked, 14)
    with pytest.raises(UpstreamMalformed):  # routes of another model than the one configured
        read_vllm(npy_text(expert_routes(ids, 0, 19, LAYERS + 1, TOPK, EXPERTS)), asked, 14)
    with pytest.raises(UpstreamMalformed):
        read_vllm(npy_text(np.zeros((14, LAYERS, TOPK), dtype=np.float32)), asked, 14)
    odd = base64.b64encode(whole[5:].astype("<i4").tobytes()[:-4]).decode()
    assert read_sglang(odd, asked, 14).missing == f"the backend's routes are not whole rows of {shape} int32 values"
    assert read_sglang(odd, RoutesAsked(5), 14).missing == (
        "sglang's routes carry no shape, and tito_routed_experts_shape is not set"
    )
    wide = expert_routes(ids, 0, 19, LAYERS, TOPK, 300)
    assert read_vllm(npy_text(wide), RoutesAsked(0, shape), 19).rows.array.dtype == np.uint16
