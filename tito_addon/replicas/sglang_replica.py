"""A faithful, GPU-less replica of an sglang (>= 0.5.13, 0.5.18+ field names) chat server.

Purpose
-------
``tito_addon`` is a token-in/token-out (TITO) proxy: it must send exact prompt token ids
and harvest exact completion token ids.  Testing that needs a backend that

* speaks sglang's OpenAI-compatible ``POST /v1/chat/completions`` *with token input*
  (``input_ids``, ``return_prompt_token_ids``, ``return_meta_info``, ``return_token_ids``,
  ``return_{input,output}_ids_in_sglext``) exactly as described in
  ``shared/docs/wire-formats.md`` section 1;
* runs over a REAL Hugging Face tokenizer (prompt rendering, completion ids, decoding);
* is deterministic, fast and needs neither torch nor a GPU.

This module is that backend's server: its routes, test controls and fault queue.  The "model" is a script
(:mod:`~tito_addon.replicas.scripted_model`): given the request messages it produces a Qwen3-format completion
(``<think>`` block, content, ``<tool_call>`` blocks, ``<|im_end|>``), which the tokenizer
(:mod:`~tito_addon.replicas.replica_tokenizer`) encodes with one or two deliberately *non-canonical* splits.
:mod:`~tito_addon.replicas.sglang_generation` turns a request into a generation and parses it the way sglang does
(reasoning parser ``qwen3``, tool-call parser ``qwen25``), so a ``max_tokens`` cut behaves like the real server;
:mod:`~tito_addon.replicas.sglang_bodies` writes sglang's answer bodies and stream from it.

It also simulates sglang's radix prefix cache (``meta_info.cached_tokens``), an older
server that silently ignores the token fields (``honor_input_ids=False`` ~ sglang
< 0.5.13), and a per-request fault queue for failure-path tests.

Entry points: :class:`ReferenceBackend` (asyncio), :class:`ReplicaThread` (a backend on
its own loop in a background thread, for sync tests) and ``python -m`` this module (the CLI,
:mod:`~tito_addon.replicas.sglang_cli`, used by ``make demo``).  No mitmproxy, no torch.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from typing import Any

from aiohttp import web

from tito_addon.replicas.engine_pause import PAUSE_MODES, EnginePause, Generation
from tito_addon.replicas.faults import TRANSPORT_FAULTS, answer_transport_fault
from tito_addon.replicas.replica_runner import BackendThread, ServedApp, json_response
from tito_addon.replicas.replica_tokenizer import load_tokenizer
from tito_addon.replicas.scripted_model import tool_functions
from tito_addon.replicas.sglang_bodies import SglangBodies
from tito_addon.replicas.sglang_config import MODEL_ID, OLD_SGLANG_VERSION, ReplicaConfig
from tito_addon.replicas.sglang_generation import (
    AbortedRequest,
    BadRequest,
    ParsedOutput,
    SglangGeneration,
    parse_output,
    reasoning_split,
    truthy,
)
from tito_addon.replicas.sglang_generation import Generation as ChatGeneration
from tito_addon.replicas.sglang_native import SglangNative, error_body
from tito_addon.replicas.vision_processing import VisionModel

__all__ = [
    "FAULT_NAMES",
    "MODEL_ID",
    "ReplicaConfig",
    "ReferenceBackend",
    "ReplicaThread",
]

#: Fault names accepted by :meth:`ReferenceBackend.set_faults` ("none" = no fault for that slot).
FAULT_NAMES: frozenset[str] = frozenset(
    {
        "none",
        "http500",
        "http429",
        "http503",
        "reset",
        "reset_early",
        "stall",
        "not_json",
        "truncated_json",
        "no_choices",
        "no_meta_info",
        "length_mismatch",
        "empty_message",
        "wrong_prompt_ids",
        "wrong_prompt_tokens",
        "nan_logprob",
    }
)
_TRANSPORT_FAULTS = frozenset({"http500", "http429", "http503"}) | TRANSPORT_FAULTS


class ReferenceBackend(ServedApp, SglangNative, SglangGeneration, SglangBodies):
    """The sglang replica: an aiohttp app plus its state (received bodies, fault queue, cache)."""

    def __init__(self, config: ReplicaConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.vision = VisionModel(config.vision) if config.vision else None
        self.received: list[dict[str, Any]] = []
        # What each answered chat request generated (prompt and completion ids, logprobs), in order.
        self.generated: list[dict[str, Any]] = []
        self.tool_turns = 0  # tool-call turns answered since the last reset (`tool_budget`)
        self.received_headers: list[dict[str, str]] = []
        self.scored: list[Any] = []  # bodies POSTed to native /generate (prompt scoring)
        self._faults: list[str] = []
        self._lock = threading.Lock()
        self._cache: list[list[int]] = []  # simulated radix cache (most recent last)
        self.pause = EnginePause()
        self.app = web.Application(client_max_size=256 * 1024 * 1024)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/get_model_info", self._model_info)
        self.app.router.add_get("/get_server_info", self._server_info)
        self.app.router.add_get("/server_info", self._server_info)
        self.app.router.add_post("/v1/chat/completions", self._chat)
        self.app.router.add_post("/generate", self._generate_native)
        self.app.router.add_post("/pause_generation", self._pause_generation)
        self.app.router.add_post("/continue_generation", self._continue_generation)
        self.app.router.add_post("/abort_request", self._abort_request)
        self.app.router.add_post("/update_weight_version", self._update_weight_version)
        self.app.router.add_post("/detokenize", self._detokenize)
        self.app.router.add_post("/separate_reasoning", self._separate_reasoning)
        self.app.router.add_post("/parse_function_call", self._parse_function_call)
        self.app.router.add_get("/_replica/requests", self._replica_requests)
        self.app.router.add_get("/_replica/generated", self._replica_generated)
        self.app.router.add_post("/_replica/faults", self._replica_faults)
        self.app.router.add_post("/_replica/reset", self._replica_reset)

    # ----------------------------------------------------------------- test controls
    def set_faults(self, faults: list[str]) -> None:
        """Replace the fault queue; each chat request pops one (FIFO). "none" = no fault."""
        bad = [f for f in faults if f not in FAULT_NAMES]
        if bad:
            raise ValueError(f"unknown fault(s) {bad}; known: {sorted(FAULT_NAMES)}")
        with self._lock:
            self._faults = list(faults)

    def pending_faults(self) -> list[str]:
        with self._lock:
            return list(self._faults)

    def received_copy(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.received)

    def generated_copy(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.generated)

    def reset(self) -> None:
        """Forget received bodies, pending faults and the simulated prefix cache."""
        with self._lock:
            self.received.clear()
            self.generated.clear()
            self.tool_turns = 0
            self.received_headers.clear()
            self._faults.clear()
            self._cache.clear()
        if self.pause.paused:  # a test that paused the engine and failed must not hold the next one's requests
            self.pause.resume()

    def _pop_fault(self) -> str | None:
        with self._lock:
            fault = self._faults.pop(0) if self._faults else None
        return None if fault in (None, "none") else fault

    # ----------------------------------------------------------------- small endpoints
    async def _health(self, request: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": MODEL_ID,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": MODEL_ID,
            "max_model_len": self.config.context_length,
        }
        return json_response({"object": "list", "data": [card]})

    async def _model_info(self, request: web.Request) -> web.Response:
        return json_response({"model_path": MODEL_ID, "tokenizer_path": self.config.tokenizer, "is_generation": True})

    async def _server_info(self, request: web.Request) -> web.Response:
        if not self.config.report_version:
            return json_response(error_body("Not Found", 404), status=404)
        return json_response(
            {
                "version": self.config.version if self.config.honor_input_ids else OLD_SGLANG_VERSION,
                "model_path": MODEL_ID,
                "served_model_name": MODEL_ID,
                "tokenizer_path": self.config.tokenizer,
                "reasoning_parser": "qwen3",
                "tool_call_parser": "qwen25",
                "reference_replica": True,
            }
        )

    async def _replica_requests(self, request: web.Request) -> web.Response:
        return json_response(self.received_copy())

    async def _replica_generated(self, request: web.Request) -> web.Response:
        # What a separate process (a README recipe, a driver) compares its records with: the ids of each answer.
        return json_response(self.generated_copy())

    async def _replica_faults(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            faults = body["faults"]
            if not isinstance(faults, list) or not all(isinstance(f, str) for f in faults):
                raise TypeError("faults must be a list of strings")
            self.set_faults(faults)
        except (ValueError, KeyError, TypeError) as exc:
            return json_response(error_body(f"bad fault request: {exc}", 400), status=400)
        return json_response({"faults": self.pending_faults()})

    async def _replica_reset(self, request: web.Request) -> web.Response:
        self.reset()
        return json_response({"status": "ok"})

    # ----------------------------------------------------------------- chat
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as exc:
            return json_response(error_body(f"Invalid JSON body: {exc}", 400), status=400)
        if not isinstance(body, dict):
            return json_response(error_body("Request body must be a JSON object.", 400), status=400)
        with self._lock:
            self.received.append(body)
            self.received_headers.append(dict(request.headers))
        fault = self._pop_fault()

        if self.config.latency_s > 0:
            await asyncio.sleep(self.config.latency_s)
        if fault in _TRANSPORT_FAULTS:
            return await self._transport_fault(request, fault)

        try:
            stream = truthy(body.get("stream"))
            self._validate(body, stream)
            gen = self._generate(body, t0)
        except BadRequest as exc:
            if stream and isinstance(exc, AbortedRequest):
                return await self._stream_abort(request, str(exc))
            return json_response(error_body(str(exc), 400), status=400)
        rid = body.get("rid")
        if isinstance(rid, str) and rid:
            if rid in self.pause.in_flight:  # sglang's tokenizer manager refuses a rid still alive
                return json_response(error_body("Duplicate request ID detected", 400), status=400)
            gen.rid = rid
        generation = await self.pause.admit(gen.rid)  # queued while the engine is paused
        try:
            if request.transport is None or request.transport.is_closing():
                # sglang aborts a request whose client disconnected (its tokenizer manager watches the connection)
                return web.Response(status=499)
            entry = {"rid": gen.rid, "prompt_ids": gen.prompt_ids, "completion_ids": gen.completion_ids,
                     "logprobs": gen.logprobs}  # fmt: skip
            with self._lock:
                self.generated.append(entry)
            if stream:
                response = await self._stream(request, body, gen, fault, lambda: self._step(generation, gen))
            elif not await self._produce(body, gen, generation, request):
                return web.Response(status=499)  # its client went away: aborted, never answered
            else:
                out = self._response_body(body, gen, request)
                if fault is not None:
                    self._apply_body_fault(out, gen, fault)
                response = json_response(out)
            with self._lock:
                entry.update(completion_ids=gen.completion_ids, logprobs=gen.logprobs, labels=list(gen.labels))
            return response
        finally:
            self.pause.finish(generation)

    async def _step(self, generation: Generation, gen: ChatGeneration) -> bool:
        """Before each token: whether the engine samples it (False once aborted), at the configured pace."""
        if not await self.pause.step(generation, self.config.weight_version):
            return False
        gen.labels = generation.labels
        if self.config.token_delay_s:
            await asyncio.sleep(self.config.token_delay_s)
        return True

    async def _produce(
        self, body: dict[str, Any], gen: ChatGeneration, generation: Generation, request: web.Request
    ) -> bool:
        """Sample the planned tokens one step at a time: an abort ends the generation with those it has; False when
        its client went away (sglang then aborts it, and nobody reads the answer)."""
        produced = 0
        for _ in gen.completion_ids:
            if not await self._step(generation, gen):
                break
            if request.transport is None or request.transport.is_closing():
                return False
            produced += 1
        if produced < len(gen.completion_ids):
            self.cut(body, gen, produced)
        return True

    # ------------------------------------------------------ weight updates (../shared/docs/weight-updates.md §1)
    async def _json_object(self, request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read() or b"{}")
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    async def _pause_generation(self, request: web.Request) -> web.Response:
        """`/pause_generation {"mode": "abort"|"retract"|"in_place"}`: answers once the pause holds."""
        try:
            mode = (await self._json_object(request)).get("mode", "abort")
        except BadRequest as exc:
            return json_response(error_body(str(exc), 400), status=400)
        if mode not in PAUSE_MODES - {"wait", "keep"}:
            return json_response(error_body(f"Invalid mode {mode!r}", 400), status=400)
        await self.pause.pause(mode)
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue_generation(self, request: web.Request) -> web.Response:
        self.pause.resume()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _abort_request(self, request: web.Request) -> web.Response:
        """`/abort_request {"rid", "abort_all"}`: sglang aborts every request whose rid starts with `rid`."""
        try:
            body = await self._json_object(request)
        except BadRequest as exc:
            return json_response(error_body(str(exc), 400), status=400)
        rid = body["rid"] if isinstance(body.get("rid"), str) else ""
        if body.get("abort_all") is True or rid:
            self.pause.abort("" if body.get("abort_all") is True else rid)
        return web.Response(status=200)

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        """`/update_weight_version {"new_version", "abort_all_requests": true}`: by default it aborts every request
        in flight (the pitfall Miles hit), then labels the next tokens with the new version."""
        try:
            body = await self._json_object(request)
        except BadRequest as exc:
            return json_response(error_body(str(exc), 400), status=400)
        version = body.get("new_version")
        if not isinstance(version, str):
            return json_response(error_body("new_version must be a string", 400), status=400)
        if body.get("abort_all_requests", True) is not False:
            self.pause.abort()
        self.config.weight_version = version
        return json_response({"success": True, "message": f"Weight version updated to {version}"})

    # ----------------------------------------------------------------- parsing routes (no generation)
    async def _detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_object(request)
        except BadRequest as exc:
            return json_response(error_body(str(exc), 400), status=400)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < self.tokenizer.size for t in tokens):
            return json_response(error_body("tokens must be a list of token ids", 400), status=400)
        skip = body.get("skip_special_tokens", True) is not False
        return json_response({"text": self.tokenizer.decode(tokens, skip_special_tokens=skip)})

    async def _separate_reasoning(self, request: web.Request) -> web.Response:
        """`/separate_reasoning {text, reasoning_parser}` with the served parser (qwen3, not forced, as the route)."""
        try:
            body = await self._json_object(request)
        except BadRequest as exc:
            return json_response(error_body(str(exc), 400), status=400)
        if body.get("reasoning_parser") != "qwen3" or not isinstance(body.get("text"), str):
            return json_response(
                {"detail": f"Unsupported reasoning parser {body.get('reasoning_parser')!r}"}, status=500
            )
        text = body["text"]
        span, normal_start = reasoning_split(text, force_reasoning=False)
        reasoning = text[span[0] : span[1]] if span else None
        return json_response({"reasoning_text": reasoning, "text": text[normal_start:]})

    async def _parse_function_call(self, request: web.Request) -> web.Response:
        """`/parse_function_call {text, tool_call_parser, tools}` with the served parser (qwen25)."""
        try:
            body = await self._json_object(request)
        except BadRequest as exc:
            return json_response(error_body(str(exc), 400), status=400)
        if body.get("tool_call_parser") != "qwen25" or not isinstance(body.get("text"), str):
            return json_response(
                {"detail": f"Unsupported tool_call_parser {body.get('tool_call_parser')!r}"}, status=500
            )
        tools = body.get("tools") if isinstance(body.get("tools"), list) else []
        names = [str(f["name"]) for f in tool_functions(tools)]
        if not names:
            return json_response({"normal_text": body["text"], "calls": []})
        parsed: ParsedOutput = parse_output(
            body["text"], separate_reasoning=False, force_reasoning=False, tool_names=set(names)
        )
        calls = [
            {"tool_index": names.index(name), "name": name, "parameters": arguments}
            for name, arguments in parsed.tool_calls
        ]
        return json_response({"normal_text": parsed.content or "", "calls": calls})

    async def _transport_fault(self, request: web.Request, fault: str) -> web.StreamResponse:
        if fault.startswith("http"):
            code = int(fault[len("http") :])
            return json_response({"object": "error", "message": "injected", "code": code}, status=code)
        return await answer_transport_fault(request, fault, self._stopping)


class ReplicaThread(BackendThread):
    """Run a :class:`ReferenceBackend` on its own event loop in a daemon thread.

    >>> with ReplicaThread(ReplicaConfig(tokenizer="../shared/tokenizers/qwen3")) as r:  # doctest: +SKIP
    ...     requests.post(r.url + "/v1/chat/completions", json={...})
    """

    thread_name = "reference-backend"
    backend: ReferenceBackend

    @staticmethod
    def _coerce_config(config: Any) -> ReplicaConfig:
        return config if isinstance(config, ReplicaConfig) else ReplicaConfig(tokenizer=str(config))

    def _make_backend(self, config: ReplicaConfig) -> ReferenceBackend:
        return ReferenceBackend(config)


if __name__ == "__main__":
    from tito_addon.replicas.sglang_cli import main

    sys.exit(main())
