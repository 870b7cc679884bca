"""Images through the engine routers the proxy supports (`tito_router`): the real vllm-router 0.1.17 and smg 1.13
(PyPI) in front of two vision-language replicas, the proxy with `tito_model_family=qwen2.5-vl`.

A router must carry what an image turn sends (vLLM: render's `features` on `/inference/v1/generate`; sglang: native
`/generate` with `image_data` and `return_prompt_token_ids`) to the engine that holds the session, and bring back the
expanded prompt ids. Where a router drops a field the turn needs, the proxy must refuse the turn loudly, never record
one the engine ran without its images: what each router does is the README's table.
"""

from __future__ import annotations

import base64
import hashlib
import io
from pathlib import Path

import openai
import pytest
from PIL import Image
from support.basics import tokenizer_path
from support.proxy_harness import Mitmdump

from tito_addon.records.record_reader import read_session
from tito_addon.replicas.engine_routers import SmgGateway, VllmRouter
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread
from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread

pytestmark = [pytest.mark.full]

TEMPLATE = Path(__file__).resolve().parents[2] / "tito_addon/engine/chat_templates/qwen2_5_vl_tools.jinja"


def png(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


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


# What each router does with an image turn: carried, or the words of the proxy's refusal.
CASES = [
    ("vllm-router", "vllm", None),
    # vllm-router's typed /generate drops `return_prompt_token_ids`: the expansion cannot be shown.
    ("vllm-router", "sglang", "backend did not echo prompt_token_ids"),
    # smg carries /generate whole, but routes none of sglang's parser routes the completion is parsed by.
    ("smg", "sglang", "sglang's /detokenize answered 404"),
]


@pytest.mark.parametrize(("router", "kind", "refusal"), CASES)
def test_a_routers_image_turns_reach_the_sessions_engine_or_are_refused(
    tmp_path: Path, router: str, kind: str, refusal: str | None
) -> None:
    shots = [png(120, 90, (9, 99, 9)), png(90, 120, (99, 9, 9)), png(64, 64, (9, 9, 99))]
    with engine(kind) as e0, engine(kind) as e1:
        gateway = SmgGateway([e0.url, e1.url]) if router == "smg" else VllmRouter([e0.url, e1.url])
        with gateway:
            options = {"tito_backend_kind": kind, "tito_router": router}
            record_dir = tmp_path / "rec"
            with Mitmdump(gateway.url, tokenizer=tokenizer_path("qwen2.5"), family="qwen2.5-vl",
                          record_dir=record_dir, cwd=tmp_path, options=options) as proxy:  # fmt: skip
                outcomes = screenshot_turns(proxy, "m" if kind == "vllm" else "reference-model", shots)
        runs = [e.generated() for e in (e0, e1)]
    recorded = read_session(record_dir, "routed")
    turns = recorded.turns if recorded is not None else []
    if refusal is None:
        assert outcomes == [None] * len(shots)
        # Every turn on the one engine that holds the session, with every image so far, ids exact.
        [held] = [r for r in runs if r]
        assert len(held) == len(turns) == len(shots)
        ids = recorded.full_ids()
        for index, (run, turn) in enumerate(zip(held, turns, strict=True)):
            assert run["prompt_ids"] == ids[turn.turn_id][0]
            expected = [hashlib.sha256(shot).hexdigest() for shot in shots[: index + 1]]
            assert [image["sha256"] for image in run["images"]] == expected
    else:
        # Refused loudly, at the first turn, and nothing recorded.
        [refused] = outcomes
        assert isinstance(refused, openai.APIStatusError) and refused.status_code == 502
        assert refusal in str(refused) and turns == []
