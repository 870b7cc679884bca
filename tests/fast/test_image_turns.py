"""Images through the proxy, token-exact: the openai SDK -> a real mitmdump (`tito_model_family=qwen2.5-vl`) -> a
vision-language engine replica that loads each image with PIL and counts it with transformers' own Qwen2-VL image
processor (vLLM 0.32 and 0.24: render answers `features`, generate takes them).

A screenshot loop: every turn the agent sends a new screenshot. Each turn's prompt must be the stored prompt and
completion plus only the new messages' ids, with each image's pad expanded where the engine expands it; the engine must
get every image of the history, each where the proxy's ids hold it; the records name each image once.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
from pathlib import Path

import openai
import pytest
from PIL import Image
from support.basics import cached_tokenizer, tokenizer_path
from support.images import IMAGE_PAD, png, screenshot_session
from support.images import image_url_part as shot_part
from support.proxy_harness import Mitmdump, post
from support.tito_commands import redrive, replay_proxy, run_cli

from tito_addon.engine.vision_tokens import QWEN2_5_VL, QWEN3_VL
from tito_addon.records.record_reader import read_session
from tito_addon.records.row_images import MissingImage
from tito_addon.records.turn_tokens import turn_text, turn_tokens
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread
from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread
from tito_addon.tools.redrive import recorded_images

TEMPLATE = Path(__file__).resolve().parents[2] / "tito_addon/engine/chat_templates/qwen2_5_vl_tools.jinja"
BACKENDS = ["sglang-0.5.23", "vllm-0.32.0", "vllm-0.24.0"]
TOOLS = [
    {
        "type": "function",
        "function": {"name": "click", "description": "Click at a point.", "parameters": {"type": "object"}},
    }
]


def hf_tokens(data: bytes) -> int:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 3136, "longest_edge": 12845056}, patch_size=14, merge_size=2
    )
    grid = processor(images=[Image.open(io.BytesIO(data))])["image_grid_thw"][0]
    return int(grid[0] * grid[1] * grid[2]) // 4


class Stack:
    def __init__(self, replica, proxy: Mitmdump, record_dir: Path) -> None:
        self.replica, self.proxy, self.record_dir = replica, proxy, record_dir

    def client(self, session: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.proxy.url + "/v1", api_key="k", default_headers={"x-session-id": session}, max_retries=0
        )

    def lines(self, session: str) -> list:
        recorded = read_session(self.record_dir, session)
        return recorded.turns if recorded is not None else []


@pytest.fixture(scope="module", params=BACKENDS)
def stack(request, tmp_path_factory):
    kind, version = request.param.split("-")
    record_dir = tmp_path_factory.mktemp(f"rec-{request.param}")
    options = {"tito_append_roles": "tool,user", "tito_images_max": "3"}
    if kind == "vllm":
        replica_thread = VllmReplicaThread(
            VllmReplicaConfig(
                tokenizer=tokenizer_path("qwen2.5"),
                version=version,
                vision="qwen2.5-vl",
                chat_template=str(TEMPLATE),
                served_model_name="tiny-qwen2.5-vl",
            )
        )
        options["tito_backend_kind"] = "vllm"
    else:
        replica_thread = ReplicaThread(
            ReplicaConfig(tokenizer=tokenizer_path("qwen2.5"), version=version, vision="qwen2.5-vl")
        )
    with (
        replica_thread as replica,
        Mitmdump(
            replica.url,
            tokenizer=tokenizer_path("qwen2.5"),
            family="qwen2.5-vl",
            record_dir=record_dir,
            cwd=record_dir.parent,
            options=options,
        ) as proxy,
    ):
        yield Stack(replica, proxy, record_dir)


def test_a_screenshot_loop_is_token_exact_and_gives_the_engine_every_image(stack: Stack) -> None:
    client = stack.client("shots")
    shots = [png(640, 480, (200, 0, 0)), png(37, 23, (0, 200, 0)), png(1288, 728, (0, 0, 200))]
    messages: list[dict] = [
        {"role": "system", "content": "You operate a computer."},
        {"role": "user", "content": [{"type": "text", "text": "Open the settings."}, shot_part(shots[0])]},
    ]
    before = len(stack.replica.generated())
    for step in range(3):
        reply = client.chat.completions.create(model="tiny-qwen2.5-vl", messages=messages, tools=TOOLS, max_tokens=200)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if step == 2:
            break
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"clicked {step}"})
        messages.append({"role": "user", "content": [{"type": "text", "text": "Now:"}, shot_part(shots[step + 1])]})
    generated = stack.replica.generated()[before:]
    turns = stack.lines("shots")
    assert len(generated) == len(turns) == 3
    sequence: list[int] = []
    for index, (engine_run, line) in enumerate(zip(generated, turns, strict=True)):
        # Token-exact and chained: each prompt is the previous prompt and completion plus only the new ids.
        assert line.parent_turn_id == (turns[index - 1].turn_id if index else None)
        prompt = sequence + line.prompt_added_ids
        assert engine_run["prompt_ids"] == prompt
        assert engine_run["completion_ids"] == line.completion_ids
        if index == 0 and line.backend_kind == "vllm":  # its own render agrees (later ones drift: the replica
            # samples non-canonical splits)
            assert line.render_skew is not None and line.render_skew["equal"] is True
        # The engine got every image of the history, each where the proxy's ids hold it.
        expected = [hashlib.sha256(shot).hexdigest() for shot in shots[: index + 1]]
        assert [image["sha256"] for image in engine_run["images"]] == expected
        for image, shot in zip(engine_run["images"], shots, strict=False):
            assert image["length"] == hf_tokens(shot)
            assert prompt[image["offset"] : image["offset"] + image["length"]] == [IMAGE_PAD] * image["length"]
            assert prompt[image["offset"] - 1] == 151652 and prompt[image["offset"] + image["length"]] == 151653
        # The record names the images the turn added, where they lie in the session's sequence.
        [added] = line.images
        assert (added.sha256, added.offset, added.length) == (
            expected[-1],
            engine_run["images"][-1]["offset"],
            engine_run["images"][-1]["length"],
        )
        assert (added.format, added.width, added.height) == ("png", *Image.open(io.BytesIO(shots[index])).size)
        sequence = prompt + line.completion_ids
    # No pixels in a record line: images are named by their digest, and kept once each in the image store, as sent,
    # though the agent sent the first one three times.
    raw = "".join(path.read_text() for path in stack.record_dir.glob("shots*.jsonl"))
    assert base64.b64encode(shots[0][:30]).decode()[:20] not in raw
    for shot in shots:
        assert (stack.record_dir / "images" / f"{hashlib.sha256(shot).hexdigest()}.png").read_bytes() == shot
    assert len([p for p in (stack.record_dir / "images").iterdir() if p.name.endswith(".png")]) == len(shots)


@pytest.mark.parametrize(
    ("part", "status", "why"),
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/shot.png"}}, 400, "fetches nothing"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}, 400, "does not decode"),
        ({"type": "image_url", "image_url": {"url": "data:image/tiff;base64,SUkqAA=="}}, 400, "not an image"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, 400, "not supported"),
    ],
)
def test_an_image_the_engine_could_not_read_is_refused_before_anything_is_sent(
    stack: Stack, part: dict, status: int, why: str
) -> None:
    received = len(stack.replica.received())
    body = {
        "model": "tiny-qwen2.5-vl",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}],
    }
    reply = post(stack.proxy.url + "/v1/chat/completions", json=body, headers={"x-session-id": "refused"})
    assert reply.status_code == status, reply.text
    assert why in json.loads(reply.text)["error"]["message"]
    assert len(stack.replica.received()) == received
    assert stack.lines("refused") == []


def jpeg_turned(width: int, height: int, orientation: int) -> bytes:
    """A JPEG stored `width`×`height` whose EXIF says to turn it: displayed `height`×`width` for 5-8."""
    image = Image.new("RGB", (width, height), (120, 60, 30))
    exif = Image.Exif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    image.save(out, format="JPEG", exif=exif)
    return out.getvalue()


def test_a_streamed_turn_with_a_turned_jpeg_is_the_turn_the_engine_ran(stack: Stack) -> None:
    """The agent asks for a stream; the JPEG's EXIF turns it (stored 300×100, shown 100×300), so its token count
    is that of the displayed size on both sides, or the engine's expansion would not be the proxy's."""
    shot = jpeg_turned(300, 100, 6)
    client = stack.client("streamed")
    before = len(stack.replica.generated())
    part = {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(shot).decode()}}
    stream = client.chat.completions.create(
        model="tiny-qwen2.5-vl",
        messages=[{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}],
        stream=True,
        max_tokens=120,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    [line] = stack.lines("streamed")
    [engine_run] = stack.replica.generated()[before:]
    assert engine_run["prompt_ids"] == line.prompt_added_ids
    assert engine_run["completion_ids"] == line.completion_ids
    assert text == (line.assistant_message.get("content") or "")
    [image] = line.images
    assert (image.format, image.width, image.height) == ("jpeg", 100, 300)
    assert image.length == hf_tokens(shot) == engine_run["images"][0]["length"]


def test_more_images_than_the_proxy_allows_are_refused(stack: Stack) -> None:
    """`tito_images_max` is 3 here (the screenshot loop's three)."""
    parts = [shot_part(png(8, 8, (i, i, i))) for i in range(4)]
    received = len(stack.replica.generated())
    body = {"model": "tiny-qwen2.5-vl", "messages": [{"role": "user", "content": parts}]}
    reply = post(stack.proxy.url + "/v1/chat/completions", json=body, headers={"x-session-id": "many"})
    assert reply.status_code == 400, reply.text
    assert "holds 4 images, over the proxy's limit of 3 (tito_images_max)" in json.loads(reply.text)["error"]["message"]
    assert len(stack.replica.generated()) == received and stack.lines("many") == []


def one_image_turn(replica, options: dict[str, str], tmp_path: Path, session: str) -> tuple[int, dict, list]:
    """A turn with one screenshot through a proxy of its own: the status, the error body, what was recorded."""
    record_dir = tmp_path / "rec"
    settings = {"tokenizer": tokenizer_path("qwen2.5"), "family": "qwen2.5-vl", "record_dir": record_dir}
    with replica, Mitmdump(replica.url, cwd=tmp_path, options=options, **settings) as proxy:
        body = {
            "model": "tiny-qwen2.5-vl",
            "messages": [
                {"role": "user", "content": [shot_part(png(640, 480, (9, 9, 9))), {"type": "text", "text": "?"}]}
            ],
        }
        reply = post(proxy.url + "/v1/chat/completions", json=body, headers={"x-session-id": session})
        recorded = read_session(record_dir, session)
    return reply.status_code, json.loads(reply.text), recorded.turns if recorded is not None else []


def test_an_sglang_too_old_for_exact_images_is_named_and_nothing_is_sent(tmp_path: Path) -> None:
    replica = ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen2.5"), version="0.5.19", vision="qwen2.5-vl"))
    status, body, turns = one_image_turn(replica, {}, tmp_path, "old")
    assert status == 400
    assert (
        "the backend is sglang 0.5.19: token-exact turns with images need sglang >= 0.5.20" in body["error"]["message"]
    )
    assert replica.generated() == [] and turns == []


def test_sglangs_silent_retokenizing_fallback_is_caught_and_nothing_is_recorded(tmp_path: Path) -> None:
    """sglang re-tokenizes when its exact path fails, logging only a warning. A first turn's canonical ids survive
    that; the second turn's prompt holds the model's own non-canonical splits (the replica samples some), which
    re-tokenizing merges: the ids sglang reports it ran on are not the proxy's, and that turn is refused."""
    config = ReplicaConfig(tokenizer=tokenizer_path("qwen2.5"), vision="qwen2.5-vl", exact_images=False)
    record_dir = tmp_path / "rec"
    settings = {"tokenizer": tokenizer_path("qwen2.5"), "family": "qwen2.5-vl", "record_dir": record_dir}
    with ReplicaThread(config) as replica, Mitmdump(replica.url, cwd=tmp_path, **settings) as proxy:
        client = openai.OpenAI(
            base_url=proxy.url + "/v1", api_key="k", default_headers={"x-session-id": "fallback"}, max_retries=0
        )
        messages = [{"role": "user", "content": [shot_part(png(64, 64, (1, 2, 3))), {"type": "text", "text": "Go."}]}]
        first = client.chat.completions.create(model="m", messages=messages, max_tokens=200)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model="m", messages=messages, max_tokens=200)
        recorded = read_session(record_dir, "fallback")
    assert refused.value.status_code == 502
    assert "fell back to re-tokenizing" in str(refused.value)
    assert len(replica.generated()) == 2
    assert recorded is not None and len(recorded.turns) == 1


def test_an_engine_that_counts_an_image_otherwise_is_refused(tmp_path: Path) -> None:
    """The proxy told of other pixel bounds than the server's processor: vLLM's render expands the image to another
    count, and the turn is refused before generate (its embeddings would land on the wrong positions)."""
    config = VllmReplicaConfig(
        tokenizer=tokenizer_path("qwen2.5"), vision="qwen2.5-vl", chat_template=str(TEMPLATE),
        served_model_name="tiny-qwen2.5-vl",
    )  # fmt: skip
    replica = VllmReplicaThread(config)
    options = {"tito_backend_kind": "vllm", "tito_image_max_pixels": str(256 * 28 * 28)}
    status, body, turns = one_image_turn(replica, options, tmp_path, "bounds")
    assert status == 502
    counted = QWEN2_5_VL.with_pixels(None, 256 * 28 * 28).image_tokens(640, 480)
    assert counted < 391
    assert (
        f"vLLM expanded image 1 (640×480) to 391 tokens where the model family counts {counted}"
        in body["error"]["message"]
    )
    assert replica.generated() == [] and turns == []


def check_images(stack: Stack, session: str, shots: list[bytes], before: int) -> None:
    """Every turn of `session` ran on the proxy's ids with every image so far, each where its ids hold it, and each
    image is kept once on disk."""
    generated = stack.replica.generated()[before:]
    turns = stack.lines(session)
    assert len(generated) == len(turns)
    sequence: list[int] = []
    digests = [hashlib.sha256(shot).hexdigest() for shot in shots]
    for engine_run, line in zip(generated, turns, strict=True):
        prompt = sequence + line.prompt_added_ids
        assert engine_run["prompt_ids"] == prompt and engine_run["completion_ids"] == line.completion_ids
        seen = [image["sha256"] for image in engine_run["images"]]
        assert seen == digests[: len(seen)]
        for image in engine_run["images"]:
            assert prompt[image["offset"] : image["offset"] + image["length"]] == [IMAGE_PAD] * image["length"]
        sequence = prompt + line.completion_ids
    assert sorted(img.sha256 for line in turns for img in line.images or []) == sorted(digests)
    for digest, shot in zip(digests, shots, strict=True):
        assert (stack.record_dir / "images" / f"{digest}.png").read_bytes() == shot
    # A line names an image by its digest, in the canonical messages and in the agent's own items alike.
    raw = "".join(path.read_text() for path in stack.record_dir.glob(f"{session}*.jsonl"))
    for shot in shots:
        assert base64.b64encode(shot).decode()[:40] not in raw
        assert base64.urlsafe_b64encode(shot).decode()[:40] not in raw


def test_anthropic_images_in_a_message_and_in_tool_results(stack: Stack) -> None:
    """As Claude Code's Read tool sends a screenshot: a tool_result holding one image block and no text."""
    import anthropic

    client = anthropic.Anthropic(base_url=stack.proxy.url, api_key="k", default_headers={"x-session-id": "claude"})
    shots = [png(200, 120, (1, 100, 1)), png(90, 300, (100, 1, 1))]

    def block(data: bytes) -> dict:
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(data).decode()}}  # fmt: skip

    before = len(stack.replica.generated())
    tools = [{"name": "click", "description": "Click.", "input_schema": {"type": "object"}}]
    messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, block(shots[0])]}]
    first = client.messages.create(model="tiny-qwen2.5-vl", max_tokens=200, messages=messages, tools=tools)
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
    calls = [b for b in first.content if b.type == "tool_use"]
    results = [{"type": "tool_result", "tool_use_id": c.id, "content": [block(shots[1])]} for c in calls]
    messages.append({"role": "user", "content": results or [block(shots[1])]})
    client.messages.create(model="tiny-qwen2.5-vl", max_tokens=200, messages=messages, tools=tools)
    check_images(stack, "claude", shots, before)


def test_responses_input_images_and_an_image_in_a_function_output(stack: Stack) -> None:
    client = stack.client("responses")
    shots = [png(120, 80, (7, 7, 70)), png(64, 64, (70, 7, 7))]

    def url(data: bytes) -> str:
        return "data:image/png;base64," + base64.b64encode(data).decode()

    before = len(stack.replica.generated())
    tools = [{"type": "function", "name": "click", "parameters": {"type": "object"}}]
    items: list[dict] = [
        {"role": "user", "content": [{"type": "input_text", "text": "See:"},
                                     {"type": "input_image", "image_url": url(shots[0]), "detail": "auto"}]}
    ]  # fmt: skip
    first = client.responses.create(model="tiny-qwen2.5-vl", input=items, tools=tools, max_output_tokens=200)
    items += [item.model_dump(exclude_none=True) for item in first.output if item.type != "reasoning"]
    calls = [item for item in first.output if item.type == "function_call"]
    if calls:
        output = [{"type": "input_image", "image_url": url(shots[1])}]
        items += [{"type": "function_call_output", "call_id": calls[0].call_id, "output": output}]
    else:
        items += [{"role": "user", "content": [{"type": "input_image", "image_url": url(shots[1]), "detail": "auto"}]}]
    client.responses.create(model="tiny-qwen2.5-vl", input=items, tools=tools, max_output_tokens=200)
    check_images(stack, "responses", shots, before)


def test_gemini_inline_data_in_a_content_and_in_a_function_response(stack: Stack) -> None:
    from google import genai
    from google.genai import types

    options = types.HttpOptions(
        base_url=stack.proxy.url, api_version="v1beta", retry_options=types.HttpRetryOptions(attempts=1),
        headers={"x-session-id": "gemini"},
    )  # fmt: skip
    client = genai.Client(api_key="k", http_options=options)
    shots = [png(150, 150, (3, 3, 3)), png(40, 80, (9, 90, 9))]
    tool = types.Tool(function_declarations=[types.FunctionDeclaration(name="click", description="Click.")])
    config = types.GenerateContentConfig(tools=[tool], max_output_tokens=200)
    before = len(stack.replica.generated())
    contents: list = [
        types.Content(
            role="user", parts=[types.Part(text="Here:"), types.Part.from_bytes(data=shots[0], mime_type="image/png")]
        )
    ]
    first = client.models.generate_content(model="tiny-qwen2.5-vl", contents=contents, config=config)
    contents.append(first.candidates[0].content)
    calls = [part.function_call for part in first.candidates[0].content.parts if part.function_call]
    image = types.Part.from_bytes(data=shots[1], mime_type="image/png")
    if calls:
        answer = types.Part.from_function_response(name=calls[0].name, response={"output": "clicked"})
        contents.append(types.Content(role="user", parts=[answer, image]))
    else:
        contents.append(types.Content(role="user", parts=[image]))
    client.models.generate_content(model="tiny-qwen2.5-vl", contents=contents, config=config)
    check_images(stack, "gemini", shots, before)


def test_a_screenshot_session_shows_and_replays_with_no_backend(tmp_path: Path) -> None:
    """`show --json` names every image of each turn's prompt where its ids hold it; replay answers the same
    screenshots with the recorded answers, and another screenshot is a miss at the message that holds it."""
    shots = [png(100, 60, (10, 20, 30)), png(60, 100, (30, 20, 10))]
    record_dir, asked, answers = screenshot_session(tmp_path, "shown", shots)
    rows = [json.loads(line) for line in run_cli("show", str(record_dir), "--json").stdout.splitlines()]
    for row, count in zip(rows, (1, 2), strict=True):
        assert [image["sha256"] for image in row["images"]] == [hashlib.sha256(s).hexdigest() for s in shots[:count]]
        for image in row["images"]:
            span = row["prompt_ids"][image["offset"] : image["offset"] + image["length"]]
            assert span == [IMAGE_PAD] * image["length"]
    shown = run_cli("show", str(record_dir)).stdout
    assert f"[image {hashlib.sha256(shots[1]).hexdigest()[:12]} 60×100]" in shown
    # The token view (mitmweb's, the browser's text) shows an image's run of pads as one line.
    first = read_session(record_dir, "shown").turns[0]
    [image] = first.images
    view = turn_text(turn_tokens(first, cached_tokenizer("qwen2.5")))
    last = image.offset + image.length - 1
    named = f"image {image.sha256[:12]} 100×60 png"
    assert f"{image.offset:>7}  {IMAGE_PAD:>7}  ⟦<|image_pad|>⟧ × {image.length} (to {last})  {named}\n" in view
    assert view.count("<|image_pad|>") == 1
    with replay_proxy(record_dir, tmp_path) as proxy:
        for messages, answer in zip(asked, answers, strict=True):
            body = {"model": "m", "messages": messages, "max_tokens": 100}
            reply = post(proxy.url + "/v1/chat/completions", json=body, headers={"x-session-id": "shown"})
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] == answer
        other = [
            *asked[1][:2],
            {"role": "user", "content": [shot_part(png(60, 100, (0, 0, 0))), {"type": "text", "text": "And now?"}]},
        ]
        miss = post(proxy.url + "/v1/chat/completions", json={"model": "m", "messages": other})
    assert miss.status_code == 404
    assert miss.json()["error"]["first_differing_message"]["index"] == 2


def test_export_rows_carry_each_image_where_the_ids_hold_it(stack: Stack, tmp_path: Path) -> None:
    """Every layout's rows hold the images as sent, in prompt order: the generic `images` with each run of pads,
    verl's `multi_modal_data` and slime's `multimodal_inputs` as those trainers keep raw media."""
    import pyarrow.parquet as pq

    client = stack.client("exported")
    messages: list[dict] = []
    for shot in (png(70, 40, (5, 50, 5)), png(40, 70, (50, 5, 5))):
        messages.append({"role": "user", "content": [shot_part(shot), {"type": "text", "text": "Then?"}]})
        reply = client.chat.completions.create(model="tiny-qwen2.5-vl", messages=messages, max_tokens=100)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
    lines = stack.lines("exported")
    digests = [image.sha256 for line in lines for image in line.images or []]
    sent = {digest: (stack.record_dir / "images" / f"{digest}.png").read_bytes() for digest in digests}
    run_cli("export", str(stack.record_dir), str(tmp_path / "g.parquet"), "--format", "generic")
    generic = [r for r in pq.read_table(tmp_path / "g.parquet").to_pylist() if r["session_id"] == "exported"]
    [row] = generic
    assert [image["sha256"] for image in row["images"]] == digests
    for image in row["images"]:
        assert image["bytes"] == sent[image["sha256"]]
        assert row["input_ids"][image["offset"] : image["offset"] + image["length"]] == [IMAGE_PAD] * image["length"]
    run_cli("export", str(stack.record_dir), str(tmp_path / "g.jsonl"), "--format", "generic", "--to", "jsonl")
    as_json = [json.loads(x) for x in (tmp_path / "g.jsonl").read_text().splitlines()]
    [line] = [r for r in as_json if r["session_id"] == "exported"]
    assert [base64.b64decode(image["bytes"]) for image in line["images"]] == [sent[d] for d in digests]
    for layout, column in (("verl", "multi_modal_data"), ("slime", "multimodal_inputs")):
        run_cli("export", str(stack.record_dir), str(tmp_path / f"{layout}.parquet"), "--format", layout)
        rows = pq.read_table(tmp_path / f"{layout}.parquet").to_pylist()
        [row] = [r for r in rows if r["session_id"] == "exported"]
        assert row[column] == {"images": [sent[d] for d in digests]}


def test_redrive_scores_a_screenshot_session_with_its_images(tmp_path: Path) -> None:
    """sglang scores the recorded ids with one pad per image and every image, and its expansion is the recorded
    one: under the checkpoint that sampled them the gap is zero, under a shifted one it is the shift."""
    shots = [png(90, 50, (1, 1, 1)), png(50, 90, (2, 2, 2))]
    record_dir, _, _ = screenshot_session(tmp_path, "scored", shots, text="Next?")
    for shift in (0.0, 0.5):
        newer = ReplicaConfig(tokenizer=tokenizer_path("qwen2.5"), vision="qwen2.5-vl", checkpoint_shift=shift)
        with ReplicaThread(newer) as scorer:
            report = redrive(record_dir, scorer.url, tmp_path / f"report-{shift}.json")
            bodies = list(scorer.backend.scored)
        assert len(report["turns"]) == 2
        assert all(turn["kl_estimate"] == pytest.approx(shift) for turn in report["turns"])
        assert [len(body["image_data"]) for body in bodies] == [1, 2]
        assert [body["input_ids"].count(IMAGE_PAD) for body in bodies] == [1, 2]
    # An image gone from the store: the turns that hold it cannot be scored (nor exported: the same reading).
    (record_dir / "images" / f"{hashlib.sha256(shots[1]).hexdigest()}.png").unlink()
    session = read_session(record_dir, "scored")
    assert session is not None
    assert [image.length for image in recorded_images(session, session.turns[0])] == [session.turns[0].images[0].length]
    with pytest.raises(MissingImage, match=f"turn 1 of scored: image {hashlib.sha256(shots[1]).hexdigest()}.png"):
        recorded_images(session, session.turns[1])


def test_qwen3_vl_screenshots_in_tool_results_are_token_exact(tmp_path: Path) -> None:
    """The qwen3-vl family (Qwen3-VL's own template: images in tool results, inside <tool_response>) on a vLLM
    0.32 replica serving that template and Qwen3-VL's processor bounds (patch 16): an Anthropic agent whose tool
    returns a new screenshot each turn."""
    import anthropic

    template = TEMPLATE.parent / "qwen3_vl_instruct.jinja"
    config = VllmReplicaConfig(
        tokenizer=tokenizer_path("qwen3"), vision="qwen3-vl", chat_template=str(template),
        served_model_name="tiny-qwen3-vl", reasoning_parser=False,
    )  # fmt: skip
    record_dir = tmp_path / "rec"
    shots = [png(320, 240, (1, 2, 3)), png(200, 100, (4, 5, 6)), png(64, 300, (7, 8, 9))]

    def block(data: bytes) -> dict:
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(data).decode()}}  # fmt: skip

    options = {"tito_backend_kind": "vllm"}
    with (
        VllmReplicaThread(config) as replica,
        Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), family="qwen3-vl", record_dir=record_dir,
                 cwd=tmp_path, options=options) as proxy,
    ):  # fmt: skip
        client = anthropic.Anthropic(base_url=proxy.url, api_key="k", default_headers={"x-session-id": "q3"})
        tools = [{"name": "screenshot", "description": "Take one.", "input_schema": {"type": "object"}}]
        messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": "Watch:"}, block(shots[0])]}]
        for shot in shots[1:]:
            reply = client.messages.create(model="tiny-qwen3-vl", max_tokens=200, messages=messages, tools=tools)
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
            calls = [b for b in reply.content if b.type == "tool_use"]
            results = [{"type": "tool_result", "tool_use_id": c.id, "content": [block(shot)]} for c in calls]
            messages.append({"role": "user", "content": results or [block(shot)]})
        client.messages.create(model="tiny-qwen3-vl", max_tokens=200, messages=messages, tools=tools)
        generated = replica.generated()
    recorded = read_session(record_dir, "q3")
    assert recorded is not None and len(recorded.turns) == len(generated) == 3
    ids = recorded.full_ids()
    for index, (run, turn) in enumerate(zip(generated, recorded.turns, strict=True)):
        assert run["prompt_ids"] == ids[turn.turn_id][0] and run["completion_ids"] == turn.completion_ids
        assert [image["sha256"] for image in run["images"]] == [
            hashlib.sha256(shot).hexdigest() for shot in shots[: index + 1]
        ]
    # Qwen3-VL counts 32-pixel squares (patch 16, merge 2) at its own bounds (65,536 pixels at least).
    counted = [image.length for turn in recorded.turns for image in turn.images or []]
    assert counted == [QWEN3_VL.image_tokens(*Image.open(io.BytesIO(shot)).size) for shot in shots]
    assert recorded.turns[0].render_skew is not None and recorded.turns[0].render_skew["equal"] is True


def test_an_sglang_image_turn_cut_by_a_weight_update_is_resumed_exactly(tmp_path: Path) -> None:
    """A trainer's `/update_weight_version` aborts an image turn's generation midway: the proxy sends the rest as a
    new `/generate` on the prompt and the partial output, the image again beside it, and records one generation,
    the one an uncut turn gives, with the versions each part was sampled under."""
    import time as clock

    from support.weight_updates import during

    config = ReplicaConfig(
        tokenizer=tokenizer_path("qwen2.5"), vision="qwen2.5-vl", token_delay_s=0.02, answer_sentences=2
    )
    record_dir = tmp_path / "rec"
    settings = {"tokenizer": tokenizer_path("qwen2.5"), "family": "qwen2.5-vl", "record_dir": record_dir}
    shot = png(96, 64, (9, 8, 7))
    messages = [{"role": "user", "content": [shot_part(shot), {"type": "text", "text": "Describe it."}]}]

    def ask(proxy: Mitmdump, session: str) -> str | None:
        client = openai.OpenAI(
            base_url=proxy.url + "/v1", api_key="k", default_headers={"x-session-id": session}, max_retries=0
        )
        return client.chat.completions.create(model="m", messages=messages, max_tokens=300).choices[0].message.content

    with ReplicaThread(config) as replica, Mitmdump(replica.url, cwd=tmp_path, **settings) as proxy:
        uncut_answer = ask(proxy, "uncut")
        replica.backend.reset()
        thread, out = during(ask, proxy, "cut")
        deadline = clock.monotonic() + 20
        while not any(len(g.labels) >= 10 for g in list(replica.backend.pause.in_flight.values())):
            assert clock.monotonic() < deadline, "the generation never got going"
            clock.sleep(0.005)
        assert post(replica.url + "/update_weight_version", json={"new_version": "v2"}).status_code == 200
        thread.join(60)
        attempts = replica.backend.generated_copy()
    assert "error" not in out, out.get("error")
    assert out["value"] == uncut_answer
    [uncut] = read_session(record_dir, "uncut").turns
    [turn] = read_session(record_dir, "cut").turns
    assert turn.completion_ids == uncut.completion_ids and turn.completion_logprobs == uncut.completion_logprobs
    first, second = attempts
    cut = len(first["completion_ids"])
    assert turn.resumed is not None and turn.resumed.cuts == [cut] and 10 <= cut < len(turn.completion_ids)
    assert second["prompt_ids"] == first["prompt_ids"] + turn.completion_ids[:cut]
    assert [i["sha256"] for i in first["images"]] == [i["sha256"] for i in second["images"]] == [turn.images[0].sha256]
    assert [span["version"] for span in turn.weight_version_spans or []] == ["default", "v2"]
