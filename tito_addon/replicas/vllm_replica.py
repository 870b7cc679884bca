"""A faithful, GPU-less replica of vLLM's scale-out token-in/token-out chain.

What it serves (``shared/docs/wire-formats.md`` section 2, and the real bodies recorded from a
live vLLM 0.32.0 in ``shared/vllm_scale_out_examples/``):

* ``POST /v1/chat/completions/render``  -- ChatCompletionRequest in, ``GenerateRequest`` out
  (prompt ids from the tokenizer's stock chat template, sampling params resolved like vLLM,
  including the real "``max_tokens: 16`` is dropped" serialization bug);
* ``POST /inference/v1/generate``       -- generates from ``token_ids`` EXACTLY as given;
* ``POST /v1/chat/completions/derender`` -- decodes the completion ids and parses them like
  vLLM's ``qwen3`` reasoning parser and ``hermes`` tool parser;
* ``GET /version``, ``GET /health``, ``GET /v1/models``.

Two wire versions: ``0.32.0`` (matches the recorded bodies key for key) and ``0.24.0`` (the
first release with derender: no usage on generate, a random generate ``request_id``,
``"token_id:N"`` logprob placeholders, the 0.24 ``GenerateRequest`` field set).

The "model" is the scripted model both replicas serve (:mod:`tito_addon.replicas.scripted_model`): generate
has no messages, so it decodes the prompt ids, recovers the Qwen3 conversation from the text
(tools in the system block, tool results, assistant turns, ``enable_thinking=False`` from a
prompt that ends in an empty think block) and lets the same script decide the completion,
with the same deliberately non-canonical token splits.

This module is the server: its routes, test controls and per-endpoint fault queue. Each endpoint's bodies are its own
module's (:mod:`~tito_addon.replicas.vllm_render`, :mod:`~tito_addon.replicas.vllm_generate`,
:mod:`~tito_addon.replicas.vllm_derender`), mixed into :class:`VllmReplica`.

Entry points: :class:`VllmReplica` (asyncio) and :class:`VllmReplicaThread` (own loop in a
background thread, for sync tests).  No torch, no GPU.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from tito_addon.replicas.engine_pause import EnginePause
from tito_addon.replicas.faults import TRANSPORT_FAULTS, answer_transport_fault
from tito_addon.replicas.replica_runner import BackendThread, ServedApp, json_response
from tito_addon.replicas.replica_tokenizer import load_tokenizer
from tito_addon.replicas.vision_processing import VisionModel
from tito_addon.replicas.vllm_config import HttpError, VllmReplicaConfig, error_body
from tito_addon.replicas.vllm_derender import DerenderEndpoint
from tito_addon.replicas.vllm_generate import GenerateEndpoint
from tito_addon.replicas.vllm_render import RenderEndpoint

__all__ = ["VLLM_FAULTS", "VllmReplica", "VllmReplicaConfig", "VllmReplicaThread"]

_RENDER = "/v1/chat/completions/render"
_GENERATE = "/inference/v1/generate"
_DERENDER = "/v1/chat/completions/derender"
_ENDPOINTS = {"render": _RENDER, "generate": _GENERATE, "derender": _DERENDER}

#: Fault kinds per endpoint (``"<endpoint>:<kind>"``); ``http<NNN>`` (any 4xx/5xx) works everywhere.
_COMMON_FAULTS = frozenset({"none"}) | TRANSPORT_FAULTS
VLLM_FAULTS: dict[str, frozenset[str]] = {
    "render": _COMMON_FAULTS,
    "generate": _COMMON_FAULTS
    | {"missing_ids", "empty_ids", "non_int_ids", "missing_logprobs", "logprobs_length", "short_prompt_ids"}
    # A streamed generation whose engine dies halfway: half its tokens sent, then the connection reset.
    | {"cut_stream"},
    "derender": _COMMON_FAULTS | {"not_chat", "empty_message"},
}
_HTTP_FAULT = re.compile(r"http([45]\d\d)")


class VllmReplica(ServedApp, RenderEndpoint, GenerateEndpoint, DerenderEndpoint):
    """The vLLM scale-out replica: an aiohttp app plus its state (received bodies, faults)."""

    def __init__(self, config: VllmReplicaConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.vision = VisionModel(config.vision) if config.vision else None
        self.chat_template = Path(config.chat_template).read_text("utf-8") if config.chat_template else None
        #: the engine's multimodal receiver cache (`lru`): an item's data by hash, once a request carried it
        self.image_items: dict[str, str] = {}
        #: ``(path, parsed body)`` of every POST to render / generate / derender, in order
        self.received: list[tuple[str, dict[str, Any]]] = []
        #: per successful generate: ``{"prompt_ids", "completion_ids", "logprobs"}``, and once it ended ``"labels"``
        #: (the weight label each token was sampled under)
        self.generated: list[dict[str, Any]] = []
        self.completed_streams = 0
        self.cancelled_streams = 0
        self._faults: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self.app = web.Application(client_max_size=256 * 1024 * 1024)
        self.app.router.add_get("/version", self._version)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_post(_RENDER, self._render)
        self.app.router.add_post(_GENERATE, self._generate)
        self.app.router.add_post(_DERENDER, self._derender)
        self.app.router.add_get("/_replica/generated", self._replica_generated)
        self.pause = EnginePause()
        if config.dev_mode:
            self.app.router.add_post("/pause", self._pause)
            self.app.router.add_post("/resume", self._resume)
            self.app.router.add_get("/is_paused", self._is_paused)
            self.app.router.add_post("/update_weight_version", self._set_weight_version)
            self.app.router.add_post("/finish_weight_update", self._set_weight_version)
            self.app.router.add_post("/inference/v1/abort_requests", self._abort_requests)

    # ----------------------------------------------------------------- test controls
    def set_faults(self, faults: list[str]) -> None:
        """Replace the fault queue.  Each entry is ``"<render|generate|derender>:<kind>"``; the
        earliest queued fault for an endpoint is consumed by the next request to it."""
        parsed: list[tuple[str, str]] = []
        for f in faults:
            ep, _, kind = f.partition(":")
            if ep not in VLLM_FAULTS or not (kind in VLLM_FAULTS[ep] or _HTTP_FAULT.fullmatch(kind)):
                known = sorted(f"{e}:{k}" for e, ks in VLLM_FAULTS.items() for k in ks)
                raise ValueError(f"unknown fault {f!r}; known: {known} and '<endpoint>:http<4xx|5xx>'")
            parsed.append((ep, kind))
        with self._lock:
            self._faults = parsed

    def pending_faults(self) -> list[str]:
        with self._lock:
            return [f"{ep}:{kind}" for ep, kind in self._faults]

    def received_copy(self) -> list[tuple[str, dict[str, Any]]]:
        with self._lock:
            return list(self.received)

    def generated_copy(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.generated)

    def reset(self) -> None:
        """Forget received bodies, generations and pending faults."""
        with self._lock:
            self.received.clear()
            self.generated.clear()
            self.completed_streams = self.cancelled_streams = 0
            self._faults.clear()
        if self.pause.paused:  # a test that paused the engine and failed must not hold the next one's requests
            self.pause.resume()

    def _pop_fault(self, endpoint: str) -> str | None:
        with self._lock:
            for i, (ep, kind) in enumerate(self._faults):
                if ep == endpoint:
                    del self._faults[i]
                    return None if kind == "none" else kind
        return None

    # ----------------------------------------------------------------- small endpoints
    async def _replica_generated(self, request: web.Request) -> web.Response:
        # What a separate process (a README recipe) compares its records with: the ids of each generation.
        return json_response(self.generated_copy())

    async def _version(self, request: web.Request) -> web.Response:
        return json_response({"version": self.config.version})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        name = self.config.served_model_name
        card = {
            "id": name,
            "object": "model",
            "created": now,
            "owned_by": "vllm",
            "root": self.config.tokenizer,
            "parent": None,
            "max_model_len": self.config.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{self._random_id()}",
                    "object": "model_permission",
                    "created": now,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        return json_response({"object": "list", "data": [card]})

    # ----------------------------------------------------------------- shared request plumbing
    async def _begin(
        self, request: web.Request, endpoint: str
    ) -> tuple[dict[str, Any] | None, web.StreamResponse | None, str | None]:
        """Read + record the body, apply gating and transport/status faults.

        Returns ``(body, None, body_fault)`` to continue, or ``(None, response, None)`` to answer
        right away.
        """
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            with self._lock:
                self.received.append((request.path, {"_raw": raw.decode("utf-8", "replace")}))
            return None, json_response(error_body(400, f"Invalid JSON body: {exc}"), status=400), None
        with self._lock:
            self.received.append((request.path, body if isinstance(body, dict) else {"_raw": body}))
        if self.v32 and not self.config.enable_scale_out:
            msg = (
                f"{request.path} is a scale-out endpoint, which is disabled on this server. "
                "Start vLLM with --enable-scale-out to enable it."
            )
            return None, json_response(error_body(403, msg), status=403), None
        fault = self._pop_fault(endpoint)
        if fault is not None:
            m = _HTTP_FAULT.fullmatch(fault)
            if m:
                code = int(m.group(1))
                body_ = error_body(code, f"injected fault ({endpoint}:{fault})")
                return None, json_response(body_, status=code), None
            if fault in TRANSPORT_FAULTS:
                return None, await answer_transport_fault(request, fault, self._stopping), None
        if not isinstance(body, dict):
            return None, json_response(error_body(400, "Request body must be a JSON object."), status=400), None
        return body, None, fault  # a remaining fault is a body fault, applied to the answer

    # ----------------------------------------------------------------- render
    async def _render(self, request: web.Request) -> web.StreamResponse:
        body, early, fault = await self._begin(request, "render")
        if early is not None:
            return early
        assert body is not None
        try:
            out = self._render_body(body, request)
        except HttpError as exc:
            return json_response(error_body(exc.status, exc.message, exc.param), status=exc.status)
        return json_response(out)

    # ----------------------------------------------------------------- generate
    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body, early, fault = await self._begin(request, "generate")
        if early is not None:
            return early
        assert body is not None
        try:
            gen = self._run_model(body, request)
        except HttpError as exc:
            return json_response(error_body(exc.status, exc.message, exc.param), status=exc.status)
        generation = await self.pause.admit(gen["request_id"])  # queued while the engine is paused
        try:
            if self.config.latency_s > 0:
                await asyncio.sleep(self.config.latency_s)
            gen["entry"] = {"prompt_ids": gen["prompt_ids"], "completion_ids": gen["ids"], "logprobs": gen["logprobs"]}
            if gen.get("images"):
                gen["entry"]["images"] = gen["images"]
            with self._lock:
                self.generated.append(gen["entry"])
            if self.v32 and body.get("stream") is True:
                return await self._stream_generate(request, body, gen, fault, generation)
            await self.produce(gen, generation)
            return json_response(self._generate_body(body, gen, fault))
        finally:
            self.pause.finish(generation)

    # ----------------------------------------------------------------- weight updates (VLLM_SERVER_DEV_MODE=1)
    async def _pause(self, request: web.Request) -> web.Response:
        """`POST /pause?mode=abort|wait|keep&clear_cache=…`: answers once the pause holds."""
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return json_response(error_body(400, f"Invalid mode {mode!r}", param="mode"), status=400)
        await self.pause.pause(mode)
        return json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.pause.resume()
        return json_response({"status": "resumed"})

    async def _is_paused(self, request: web.Request) -> web.Response:
        return json_response({"is_paused": self.pause.paused})

    async def _set_weight_version(self, request: web.Request) -> web.Response:
        """`/update_weight_version {"new_version"}` and `/finish_weight_update {"weight_version"}`: the label the
        next tokens are stamped with (neither aborts anything in vLLM)."""
        try:
            body = json.loads(await request.read() or b"{}")
        except ValueError:
            return json_response(error_body(400, "Invalid JSON body"), status=400)
        key = "new_version" if request.path.endswith("update_weight_version") else "weight_version"
        version = body.get(key) if isinstance(body, dict) else None
        if version is not None:
            self.config.weight_version = str(version)
        return json_response({"status": "ok", "weight_version": self.config.weight_version})

    async def _abort_requests(self, request: web.Request) -> web.Response:
        """`/inference/v1/abort_requests {"request_ids": [...]}`: those (all, for none) end as aborted."""
        try:
            body = json.loads(await request.read() or b"{}")
        except ValueError:
            return json_response(error_body(400, "Invalid JSON body"), status=400)
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if not ids:
            self.pause.abort()
        else:  # vLLM matches whole ids (sglang matches prefixes), the client's or the one it answered with
            self.pause.abort(exact=frozenset(ids) | {f"generate-tokens-{rid}" for rid in ids})
        return json_response({"status": "ok"})

    # ----------------------------------------------------------------- derender
    async def _derender(self, request: web.Request) -> web.StreamResponse:
        body, early, fault = await self._begin(request, "derender")
        if early is not None:
            return early
        assert body is not None
        if body.get("stream") is True and self.config.derender_delay_s > 0:
            await asyncio.sleep(self.config.derender_delay_s)
        try:
            out = self._derender_body(body)
        except HttpError as exc:
            return json_response(error_body(exc.status, exc.message, exc.param), status=exc.status)
        if fault == "not_chat":
            choice = out["choices"][0]
            out = {
                "id": out["id"],
                "object": "text_completion",
                "created": out["created"],
                "model": out["model"],
                "choices": [
                    {
                        "index": 0,
                        "text": choice["message"].get("content"),
                        "logprobs": None,
                        "finish_reason": choice["finish_reason"],
                    }
                ],
                "usage": out["usage"],
            }
        elif fault == "empty_message":
            msg = out["choices"][0]["message"]
            msg.update({"content": None, "reasoning": None})
            msg.pop("tool_calls", None)
        return json_response(out)


class VllmReplicaThread(BackendThread):
    """Run a :class:`VllmReplica` on its own event loop in a daemon thread.

    Same surface as :class:`~tito_addon.replicas.sglang_replica.ReplicaThread`: context manager,
    ``.url``, ``.backend``, ``.received()`` (``(path, body)`` tuples), ``.generated()``,
    ``.set_faults()``, ``.clear()``.
    """

    thread_name = "vllm-replica"
    backend: VllmReplica

    @staticmethod
    def _coerce_config(config: Any) -> VllmReplicaConfig:
        return config if isinstance(config, VllmReplicaConfig) else VllmReplicaConfig(tokenizer=str(config))

    def _make_backend(self, config: Any) -> VllmReplica:
        return VllmReplica(config)

    def received(self) -> list[tuple[str, dict[str, Any]]]:  # type: ignore[override]
        return self.backend.received_copy()
