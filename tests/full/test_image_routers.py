"""Images through the engine routers the proxy supports (`tito_router`): the real vllm-router 0.1.17 and smg 1.13
(PyPI) in front of two vision-language replicas, the proxy with `tito_model_family=qwen2.5-vl`.

A router must carry what an image turn sends (vLLM: render's `features` on `/inference/v1/generate`; sglang: native
`/generate` with `image_data` and `return_prompt_token_ids`) to the engine that holds the session, and bring back the
expanded prompt ids. Where a router drops a field the turn needs, the proxy must refuse the turn loudly, never record
one the engine ran without its images: what each router does is the README's table.

Measured here: vllm-router carries vLLM's image turns. In front of sglang, vllm-router's typed `/generate` drops
`return_prompt_token_ids`, and smg carries `/generate` but routes none of sglang's parser routes: the proxy refuses
sglang image turns behind either router before sending anything.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import openai
import pytest
import requests
from support.basics import tokenizer_path
from support.images import png
from support.proxy_harness import Mitmdump

from tito_addon.records.record_reader import read_session
from tito_addon.replicas.engine_routers import SmgGateway, VllmRouter
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread
from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread

pytestmark = [pytest.mark.full]

TEMPLATE = Path(__file__).resolve().parents[2] / "tito_addon/engine/chat_templates/qwen2_5_vl_tools.jinja"


def engine(kind: str):
    if kind == "vllm":
        config = VllmReplicaConfig(
            tokenizer=tokenizer_path("qwen2.5"), vision="qwen2.5-vl", chat_template=str(TEMPLATE)
        )
        return VllmReplicaThread(config)
    return ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen2.5"), vision="qwen2.5-vl"))


def screenshot_turns(proxy: Mitmdump, model: str, shots: list[bytes]) -> list[BaseException | None]:
    client = openai.OpenAI(
        base_url=proxy.url + "/v1", api_key="k", max_retries=0, default_headers={"x-session-id": "routed"}
    )
    messages: list[dict] = []
    outcomes: list[BaseException | None] = []
    for shot in shots:
        url = "data:image/png;base64," + base64.b64encode(shot).decode()
        messages.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                     {"type": "text", "text": "And now?"}]})  # fmt: skip
        try:
            reply = client.chat.completions.create(model=model, messages=messages, max_tokens=100)
        except openai.APIStatusError as exc:
            outcomes.append(exc)
            break
        outcomes.append(None)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
    return outcomes


def test_vllm_router_carries_vllms_image_turns_to_the_sessions_engine(tmp_path: Path) -> None:
    shots = [png(120, 90, (9, 99, 9)), png(90, 120, (99, 9, 9)), png(64, 64, (9, 9, 99))]
    with engine("vllm") as e0, engine("vllm") as e1, VllmRouter([e0.url, e1.url]) as gateway:
        options = {"tito_backend_kind": "vllm", "tito_router": "vllm-router"}
        record_dir = tmp_path / "rec"
        with Mitmdump(gateway.url, tokenizer=tokenizer_path("qwen2.5"), family="qwen2.5-vl", record_dir=record_dir,
                      cwd=tmp_path, options=options) as proxy:  # fmt: skip
            assert screenshot_turns(proxy, "m", shots) == [None] * len(shots)
        runs = [e.generated() for e in (e0, e1)]
    recorded = read_session(record_dir, "routed")
    assert recorded is not None
    # Every turn on the one engine that holds the session, with every image so far, ids exact.
    [held] = [r for r in runs if r]
    assert len(held) == len(recorded.turns) == len(shots)
    ids = recorded.full_ids()
    for index, (run, turn) in enumerate(zip(held, recorded.turns, strict=True)):
        assert run["prompt_ids"] == ids[turn.turn_id][0]
        expected = [hashlib.sha256(shot).hexdigest() for shot in shots[: index + 1]]
        assert [image["sha256"] for image in run["images"]] == expected


def test_sglang_image_turns_through_a_router_are_refused_before_anything_is_sent(tmp_path: Path) -> None:
    """What each router does to what an sglang image turn needs, measured on the router itself, and the proxy's
    refusal of those turns up front (`sglang_generate.ROUTERS_WITHOUT_IMAGES`)."""
    shot = png(120, 90, (9, 99, 9))
    with engine("sglang") as e0, engine("sglang") as e1:
        for router, gateway in (("vllm-router", VllmRouter([e0.url, e1.url])), ("smg", SmgGateway([e0.url, e1.url]))):
            with gateway:
                url = "data:image/png;base64," + base64.b64encode(shot).decode()
                body = {"input_ids": [151652, 151655, 151653, 9707], "image_data": [url],
                        "return_prompt_token_ids": True, "sampling_params": {"max_new_tokens": 4}}  # fmt: skip
                generated = requests.post(gateway.url + "/generate", json=body, timeout=60)
                detokenized = requests.post(gateway.url + "/detokenize", json={"tokens": [9707]}, timeout=60)
                if router == "vllm-router":  # the engine's expanded ids do not come back
                    assert generated.status_code == 200 and "prompt_token_ids" not in generated.json()
                else:  # /generate is carried whole, the parser routes are not routed at all
                    assert generated.status_code == 200 and len(generated.json()["prompt_token_ids"]) > 4
                    assert detokenized.status_code == 404
                before = len(e0.generated()) + len(e1.generated())
                options = {"tito_router": router}
                record_dir = tmp_path / router
                with Mitmdump(gateway.url, tokenizer=tokenizer_path("qwen2.5"), family="qwen2.5-vl",
                              record_dir=record_dir, cwd=tmp_path, options=options) as proxy:  # fmt: skip
                    [refused] = screenshot_turns(proxy, "reference-model", [shot])
                assert isinstance(refused, openai.APIStatusError) and refused.status_code == 400
                assert f"turns with images cannot reach sglang through {router}" in str(refused)
                assert len(e0.generated()) + len(e1.generated()) == before
                assert read_session(record_dir, "routed") is None
