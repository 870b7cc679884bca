"""sglang's native `/generate`, mixed into the sglang replica: scoring given ids (`max_new_tokens: 0`, as re-drive
asks), and generating from given ids, with the images of `image_data` when the replica serves a vision-language model.

A generation runs the chat endpoint's model (its pause, abort and resumption) on the ids after image expansion and
answers in `/generate`'s shape. Images are expanded as sglang does from 0.5.13 (`SGLANG_MM_AVOID_RETOKENIZE`): each
`<|image_pad|>` of `input_ids` repeated for its image, every other id kept; where that fails, sglang's silent fallback
decodes the ids and re-tokenizes the text (`exact_images=False` forces it, as a JPEG on a CUDA server did before
0.5.20).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

from aiohttp import web

from tito_addon.replicas.engine_pause import EnginePause
from tito_addon.replicas.expert_routing import route_rows, sglang_routes_b64
from tito_addon.replicas.replica_runner import json_response
from tito_addon.replicas.replica_tokenizer import ReplicaTokenizer
from tito_addon.replicas.scripted_model import logprob
from tito_addon.replicas.sglang_config import ReplicaConfig
from tito_addon.replicas.sglang_generation import BadRequest, truthy
from tito_addon.replicas.vision_processing import IMAGE_PAD, ImageLoadError, VisionModel, expand


def error_body(message: str, code: int, err_type: str = "BadRequestError") -> dict[str, Any]:
    """sglang's error body (`ErrorResponse`)."""
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": code}


class SglangNative:
    """The native `/generate` handler (mixed into the replica: reads its config, tokenizer and model run)."""

    config: ReplicaConfig
    tokenizer: ReplicaTokenizer
    vision: VisionModel | None
    scored: list[Any]
    generated: list[dict[str, Any]]
    pause: EnginePause
    _lock: threading.Lock

    # The chat endpoint's model run and bodies (`SglangGeneration`, `SglangBodies`, the replica's own).
    _generate: Any
    _produce: Any
    _meta_info: Any
    _logprob_entries: Any
    _routes: Any
    _check_routes_start: Any

    async def _generate_native(self, request: web.Request) -> web.Response:
        """sglang's native /generate: scoring given ids (`max_new_tokens: 0` -> `meta_info.input_token_logprobs`,
        [logprob, id, text]), or generating from them, with the images of `image_data` when the server serves a
        vision-language model."""
        t0 = time.monotonic()
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            return json_response(error_body(f"Invalid JSON body: {exc}", 400), status=400)
        ids = body.get("input_ids") if isinstance(body, dict) else None
        with self._lock:
            self.scored.append(body)
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            return json_response(error_body("input_ids must be a non-empty list of ints", 400), status=400)
        sampling = body.get("sampling_params") or {}
        # A body that asks for no tokens is a score, as re-drive sends (one that names no budget generates where it
        # holds images; without, it is taken for a score too, the replica's older use).
        if sampling.get("max_new_tokens", None if body.get("image_data") else 0) != 0:
            return await self._generate_from_ids(request, body, ids, sampling, t0)
        try:  # the scheduler's check of the routes' start: an abort whose message /generate answers as a 400
            ids, _ = self._with_images(ids, body.get("image_data"))
            self._check_routes_start(len(ids), body)
        except BadRequest as exc:
            return json_response({"error": {"message": str(exc)}}, status=400)
        routes_from = None  # where the routes start (an older server: always 0), None for no routes
        if self.config.routed_experts and truthy(body.get("return_routed_experts")):
            routes_from = body.get("routed_experts_start_len", 0) if self.config.honor_input_ids else 0
        start = body.get("logprob_start_len", -1)
        start = len(ids) - 1 if not isinstance(start, int) or start < 0 else start
        shift = self.config.checkpoint_shift
        # Position-relative to the scored span, the same function the chat endpoint samples with: the same
        # "checkpoint" scores a recorded completion exactly as it generated it.
        scored = [[logprob(i - start, t) - shift, t, None] for i, t in enumerate(ids) if i >= start]
        meta = {"id": uuid.uuid4().hex, "finish_reason": {"type": "length", "length": 0},
                "prompt_tokens": len(ids), "completion_tokens": 0, "cached_tokens": 0,
                "input_token_logprobs": scored if body.get("return_logprob") else [],
                "output_token_logprobs": []}  # fmt: skip
        if routes_from is not None:  # no output: rows [start, prompt - 1)
            meta["routed_experts"] = sglang_routes_b64(route_rows(self.config, ids, routes_from))
        out: dict[str, Any] = {"text": "", "output_ids": [], "meta_info": meta}
        if truthy(body.get("return_prompt_token_ids")):
            out["prompt_token_ids"] = ids
        return json_response(out)

    def _with_images(self, ids: list[int], image_data: Any) -> tuple[list[int], list[dict[str, Any]]]:
        """The ids the model runs on: each `<|image_pad|>` expanded for its image, the other ids as sent (the exact
        path); where that fails, sglang's fallback: the ids decoded and the text re-tokenized, then expanded."""
        if not image_data:
            return ids, []
        if self.vision is None:
            raise BadRequest("The model does not support image input.")
        if not isinstance(image_data, list):
            image_data = [image_data]
        try:
            images = [self.vision.load(item) for item in image_data]
        except ImageLoadError as exc:
            raise BadRequest(f"Failed to load image: {exc}") from exc
        pad = self.tokenizer.vocab[IMAGE_PAD]
        exact = expand(ids, pad, images) if self.config.exact_images else None
        if exact is None:  # "falling back to decode+retokenize, which may change prompt length (token drift)"
            retokenized = self.tokenizer.encode(self.tokenizer.decode(ids))
            exact = expand(retokenized, pad, images)
            if exact is None:
                raise BadRequest(f"prompt has {retokenized.count(pad)} image placeholder(s) for {len(images)} images")
        expanded, runs = exact
        return expanded, [
            {"image": image, "sha256": image.sha256, **run} for image, run in zip(images, runs, strict=True)
        ]

    async def _generate_from_ids(
        self, request: web.Request, body: dict[str, Any], ids: list[int], sampling: dict[str, Any], t0: float
    ) -> web.Response:
        """A generation on given ids: the chat endpoint's model run (its pause, abort and resumption included) on
        the ids after image expansion, answered in /generate's shape."""
        try:
            prompt_ids, images = self._with_images(ids, body.get("image_data"))
            seen = [placed.pop("image") for placed in images]
            chat_like = {"messages": [{"role": "user", "content": ""}], "input_ids": prompt_ids, "_images": seen,
                         "max_tokens": sampling.get("max_new_tokens"), "stop": sampling.get("stop"),
                         "return_routed_experts": body.get("return_routed_experts"),
                         "routed_experts_start_len": body.get("routed_experts_start_len", 0)}  # fmt: skip
            gen = self._generate(chat_like, t0)
        except BadRequest as exc:
            return json_response({"error": {"message": str(exc)}}, status=400)
        rid = body.get("rid")
        if isinstance(rid, str) and rid:
            gen.rid = rid
        generation = await self.pause.admit(gen.rid)
        try:
            entry = {"rid": gen.rid, "prompt_ids": gen.prompt_ids, "completion_ids": gen.completion_ids,
                     "logprobs": gen.logprobs, "images": images}  # fmt: skip
            with self._lock:
                self.generated.append(entry)
            if not await self._produce(chat_like, gen, generation, request):
                return web.Response(status=499)
            meta = self._meta_info(chat_like, gen, truthy(body.get("return_logprob")))
            top = body.get("top_logprobs_num")
            if isinstance(top, int) and top > 0:
                entries = self._logprob_entries(gen, 0, len(gen.completion_ids), top)
                meta["output_top_logprobs"] = [
                    [[alt["logprob"], None, alt["token"]] for alt in entry["top_logprobs"]] for entry in entries
                ]
            routes = self._routes(chat_like, gen)
            if routes is not None:
                meta["routed_experts"] = routes
            out: dict[str, Any] = {"text": gen.text, "output_ids": gen.completion_ids, "meta_info": meta}
            if truthy(body.get("return_prompt_token_ids")):
                out["prompt_token_ids"] = gen.prompt_ids
            with self._lock:
                entry.update(completion_ids=gen.completion_ids, logprobs=gen.logprobs, labels=list(gen.labels))
            return json_response(out)
        finally:
            self.pause.finish(generation)
