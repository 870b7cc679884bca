"""MoE routes through the engine routers the proxy supports (`tito_router`): the real vllm-router 0.1.17 and smg 1.13
(PyPI) in front of two replicas started with `--enable-return-routed-experts`, the proxy with `tito_routed_experts`.

Each router must carry the route fields both ways: the request's (sglang's chat `return_routed_experts` and
`routed_experts_start_len`, vLLM's `sampling_params.routed_experts_prompt_start`) and the answer's routes. A turn's
recorded routes are then compared with what the engine computed for its exact ids, position for position.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openai
import pytest
from support.basics import tokenizer_path
from support.chat_agent import take_turn
from support.engine_logs import engine_of
from support.proxy_harness import Mitmdump

from tito_addon.records.record_reader import read_session
from tito_addon.records.recorded_routes import sequence_routes
from tito_addon.replicas.engine_routers import SmgGateway, VllmRouter
from tito_addon.replicas.expert_routing import expert_routes
from tito_addon.replicas.sglang_replica import MODEL_ID as SGLANG_MODEL

pytestmark = [pytest.mark.full]

LAYERS, TOPK, EXPERTS = 3, 2, 8
MOE = {"routed_experts": True, "moe_layers": LAYERS, "moe_topk": TOPK, "moe_experts": EXPERTS}


@pytest.mark.parametrize(("router", "kind"), [("vllm-router", "vllm"), ("vllm-router", "sglang"), ("smg", "sglang")])
def test_a_routers_sessions_record_every_tokens_route(tmp_path: Path, router: str, kind: str) -> None:
    with engine_of(kind, **MOE) as e0, engine_of(kind, **MOE) as e1:
        urls = [e0.url, e1.url]
        gateway = SmgGateway(urls) if router == "smg" else VllmRouter(urls)
        with gateway:
            options = {"tito_backend_kind": kind, "tito_router": router, "tito_routed_experts": "true",
                       "tito_routed_experts_shape": f"{LAYERS}x{TOPK}"}  # fmt: skip
            record_dir = tmp_path / "rec"
            with Mitmdump(gateway.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
                          options=options) as proxy:  # fmt: skip
                client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0,
                                       default_headers={"x-session-id": "routed"})  # fmt: skip
                model = "m" if kind == "vllm" else SGLANG_MODEL
                messages: list[dict] = [{"role": "user", "content": "Weather in Paris?"}]
                for turn, stream in enumerate([False, True, False]):
                    take_turn(client, messages, model=model, stream=stream, result=f"{turn}C")
        asked = sorted(start for engine in (e0, e1) for start in starts_received(engine, kind))
    recorded = read_session(record_dir, "routed")
    assert recorded is not None and len(recorded.turns) == 3
    ids = recorded.full_ids()
    through = 0
    for turn in recorded.turns:
        ref = turn.routed_experts
        assert ref is not None and ref.missing is None, ref
        assert ref.start == through  # only the positions no earlier turn routed were asked for, and kept
        through = turn.routed_experts_through
        prompt, completion = ids[turn.turn_id]
        routes = sequence_routes(recorded, turn.turn_id)
        assert routes is not None and routes.complete
        sequence = prompt + completion
        assert np.array_equal(routes.array, expert_routes(sequence, 0, len(sequence) - 1, LAYERS, TOPK, EXPERTS))
    # The engines got each start the proxy sent through the router.
    assert asked == sorted(turn.routed_experts.start for turn in recorded.turns if turn.routed_experts)


def starts_received(engine, kind: str) -> list[int]:
    """The route starts an engine was asked for (sglang's chat field, vLLM's sampling parameter)."""
    if kind == "vllm":
        bodies = [body for path, body in engine.received() if path.endswith("/generate")]
        return [b["sampling_params"]["routed_experts_prompt_start"] for b in bodies]
    return [body["routed_experts_start_len"] for body in engine.backend.received_copy() if body.get("input_ids")]
