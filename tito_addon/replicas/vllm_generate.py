"""vLLM's ``POST /inference/v1/generate``: generates from ``token_ids`` EXACTLY as given.

Generate has no messages: it decodes the prompt ids, recovers the Qwen3 conversation from the text and lets the
scripted model decide the completion, with its non-canonical splits. Answers in the version's shape (0.32: usage,
``weight_versions`` spans, integer-id logprobs, a per-token SSE stream; 0.24: a random ``request_id`` and
``"token_id:N"`` logprob placeholders), with the generate-only body faults applied. With the server's
``--enable-return-routed-experts`` (``routed_experts``) each finished choice carries its routes, as a ``.npy``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Any

from aiohttp import web

from tito_addon.replicas.engine_pause import EnginePause, Generation, spans_of
from tito_addon.replicas.expert_routing import route_rows, vllm_routes_b64
from tito_addon.replicas.replica_tokenizer import noncanonical_ids
from tito_addon.replicas.scripted_model import completion_text, conversation_from_prompt, logprob, script_turn
from tito_addon.replicas.vision_processing import SeenImage, described
from tito_addon.replicas.vllm_config import MAX_TOP_LOGPROBS, HttpError, VllmEndpoint, bad_request, is_int


class GenerateEndpoint(VllmEndpoint):
    """The generate endpoint's model run, bodies and stream (the replica's ``_generate`` handler answers with them);
    counts the streams it completed and those whose client went away."""

    completed_streams: int
    cancelled_streams: int
    generated: list[dict[str, Any]]
    pause: EnginePause
    image_items: dict[str, str]
    _lock: threading.Lock

    def _run_model(self, body: dict[str, Any], request: web.Request) -> dict[str, Any]:
        tok = self.tokenizer
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids:
            raise bad_request("token_ids: List should have at least 1 item after validation", param="token_ids")
        if not all(is_int(t) for t in ids):
            raise bad_request("token_ids: Input should be a valid integer", param="token_ids")
        if any(t < 0 for t in ids):
            raise bad_request("token_ids must not contain negative values", param="token_ids")
        bad = next((t for t in ids if t >= tok.size), None)
        if bad is not None:
            raise bad_request(f"Token id {bad} is out of vocabulary", param="token_ids")
        sp = body.get("sampling_params")
        if not isinstance(sp, dict):
            raise bad_request("sampling_params: Field required", param="sampling_params")
        self._check_model(body.get("model"))
        if self.v32 and body.get("output_mode", "tokens") != "tokens":
            raise bad_request("this replica only serves output_mode 'tokens'", param="output_mode")
        room = self._room(len(ids))
        max_tokens = sp.get("max_tokens")  # absent -> server default: the rest of the context
        if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 1):
            raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
        limit = room if max_tokens is None else min(max_tokens, room)
        k = sp.get("logprobs")
        if k is not None and (not is_int(k) or k < -1):
            raise bad_request("logprobs must be a non-negative integer or -1", param="logprobs")
        routes_from = self._routes_start(sp, len(ids))
        images = self._features_in(body.get("features"), len(ids))

        prompt_ids = [int(t) for t in ids]
        continued = self.pause.continuation(prompt_ids)
        if continued is not None:  # a cut generation's prompt + partial output: it goes on where it was cut
            out, offset = list(continued[0]), continued[1]
        else:
            conv, thinking = conversation_from_prompt(described(tok.decode(prompt_ids), [i for i, _ in images]))
            script = script_turn(conv, thinking, answer_sentences=self.config.answer_sentences)
            text, spans, fallback = completion_text(script)
            out, _ = noncanonical_ids(tok, text, spans, fallback, enabled=self.config.noncanonical)
            out.append(tok.im_end)
            offset = 0
        root = prompt_ids[: len(prompt_ids) - offset]
        plan = prompt_ids[len(root) :] + out
        finish, stop_reason = "stop", None
        if len(out) > limit:
            out, finish = out[:limit], "length"
        stopped = tok.stop_in(out, sp.get("stop"))
        if stopped is not None:
            out, finish, stop_reason = out[: stopped[0]], "stop", stopped[1]
        rid = request.headers.get("X-Request-Id") or (
            body["request_id"] if isinstance(body.get("request_id"), str) and body["request_id"] else self._random_id()
        )
        return {
            "request_id": f"generate-tokens-{rid}" if self.v32 else uuid.uuid4().hex,
            "prompt_ids": prompt_ids,
            "ids": out,
            "logprobs": [logprob(offset + i, t) for i, t in enumerate(out)],
            "finish": finish,
            "stop_reason": stop_reason,
            "root": root,
            "plan": plan,
            "labels": [],
            "top_k": None if k is None else (MAX_TOP_LOGPROBS if k == -1 else min(k, MAX_TOP_LOGPROBS)),
            "routes_from": routes_from,
            "images": [
                {"sha256": seen.sha256, "width": seen.width, "height": seen.height, **run} for seen, run in images
            ],
        }

    def _features_in(self, features: Any, n_ids: int) -> list[tuple[SeenImage, dict[str, int]]]:
        """The images a generate request's `features` place, checked as the server checks them (0.32's
        `MultiModalFeatures` validator and bounds check, then the model runner's count of embeddings against
        placeholders); an item without data is taken from the receiver cache, where an earlier request left it."""
        if features is None:
            return []
        if not isinstance(features, dict) or not all(
            isinstance(features.get(k), dict) for k in ("mm_hashes", "mm_placeholders")
        ):
            raise bad_request("features: mm_hashes and mm_placeholders must be objects", param="features")
        hashes, placeholders = features["mm_hashes"], features["mm_placeholders"]
        data = features.get("kwargs_data")
        if self.v32 and (set(hashes) != set(placeholders) or (isinstance(data, dict) and set(data) != set(hashes))):
            raise bad_request("features: modality keys must match across mm_hashes, mm_placeholders and kwargs_data")
        if set(hashes) - {"image"}:
            raise bad_request("this replica serves image features only", param="features")
        runs = placeholders.get("image") or []
        digests = hashes.get("image") or []
        items = (data or {}).get("image") if isinstance(data, dict) else None
        items = items if items is not None else [None] * len(runs)
        if not (len(runs) == len(digests) == len(items)):
            raise bad_request("features: mm_hashes, mm_placeholders and kwargs_data differ in length per modality")
        end = 0
        out: list[tuple[SeenImage, dict[str, int]]] = []
        for digest, run, item in zip(digests, runs, items, strict=True):
            offset, length = (run.get("offset"), run.get("length")) if isinstance(run, dict) else (None, None)
            if not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length < 1:
                raise bad_request("features: a placeholder needs offset >= 0 and length > 0", param="features")
            if self.v32 and offset < end:
                raise bad_request("features: mm_placeholders must be globally non-overlapping and sorted")
            if self.v32 and offset + length > n_ids:
                raise bad_request("mm_placeholders must remain within the token_ids sequence", param="features")
            end = offset + length
            if item is None:
                item = self.image_items.get(digest)
                if item is None:
                    raise HttpError(500, f"Expected a cached item for mm_hash={digest!r}")
            self.image_items[digest] = item
            seen = SeenImage.from_item(item)
            t, h, w = seen.grid
            tokens = t * h * w // 4
            if tokens != length:
                raise HttpError(500, f"Attempted to assign {tokens} multimodal tokens to {length} placeholders")
            out.append((seen, {"offset": offset, "length": length}))
        return out

    def _routes_start(self, sp: dict[str, Any], n_prompt: int) -> int:
        """`sampling_params.routed_experts_prompt_start`: 0.32's input processor refuses one outside [0, prompt
        length], the server flag on or off; 0.24 checks nothing (its scheduler asserts), here it is clamped."""
        start = sp.get("routed_experts_prompt_start")
        if start is None:
            return 0
        if not is_int(start):
            raise bad_request(
                "routed_experts_prompt_start: Input should be a valid integer", param="routed_experts_prompt_start"
            )
        if not self.v32:
            return min(max(start, 0), n_prompt)
        if not 0 <= start <= n_prompt:
            raise bad_request(
                f"routed_experts_prompt_start must be between 0 and the prompt length ({n_prompt}), inclusive. "
                f"(parameter=routed_experts_prompt_start, value={start})",
                param="routed_experts_prompt_start",
            )
        return start

    def _routes(self, gen: dict[str, Any]) -> str | None:
        """`routed_experts` of a finished generation: base64 `.npy` of the rows `[start, num_tokens - 1)` over the
        prompt and the output ids it kept (a stop string's trim drops their rows too); None with the server flag
        off, or for an abort before any forward pass (no token sampled)."""
        if not self.config.routed_experts or not gen["ids"]:
            return None
        rows = route_rows(self.config, gen["prompt_ids"] + gen["ids"], gen["routes_from"])
        return vllm_routes_b64(rows, self.config.moe_experts)

    def _alternatives(self, tid: int, count: int) -> list[int]:
        first_added = self.tokenizer.first_added
        return [(tid + 7919 * j) % first_added for j in range(1, count + 1)]

    def _logprob_entry(self, gen: dict[str, Any], i: int, top_k: int) -> dict[str, Any]:
        """One position, in the version's shape; ``top_logprobs`` = the first ``top_k`` of
        (sampled, alternatives...), as recorded (``logprobs: 1`` lists only the sampled token)."""
        tid, lp = gen["ids"][i], gen["logprobs"][i]
        cands = [(tid, lp, 1)] + [
            (alt, round(lp - 1.5 * j, 6), j + 1) for j, alt in enumerate(self._alternatives(tid, top_k), start=1)
        ]
        cands = cands[: max(top_k, 0)]
        if self.v32:
            return {
                "token_id": tid,
                "logprob": lp,
                "rank": 1,
                "top_logprobs": [{"token_id": t, "logprob": v, "rank": r} for t, v, r in cands],
            }
        return {
            "token": f"token_id:{tid}",
            "logprob": lp,
            "bytes": None,
            "top_logprobs": [{"token": f"token_id:{t}", "logprob": v, "bytes": None} for t, v, _ in cands],
        }

    def _logprobs(self, gen: dict[str, Any], lo: int, hi: int, fault: str | None) -> dict[str, Any] | None:
        top_k = gen["top_k"]
        if fault == "missing_logprobs":
            return None
        if top_k is None and fault != "logprobs_length":
            return None
        entries = [self._logprob_entry(gen, i, top_k or 0) for i in range(lo, hi)]
        if fault == "logprobs_length" and hi == len(gen["ids"]) and entries:
            del entries[-1]
        return {"content": entries}

    @staticmethod
    def _echo(prompt_ids: list[int], fault: str | None) -> list[int]:
        """The prompt ids generate reports it ran on; ``short_prompt_ids``: one fewer than it was sent."""
        return list(prompt_ids[:-1] if fault == "short_prompt_ids" else prompt_ids)

    @staticmethod
    def _ids_with_fault(ids: list[int], fault: str | None) -> Any:
        if fault == "empty_ids":
            return []
        if fault == "non_int_ids":
            return [str(t) for t in ids]
        return list(ids)

    def _generate_body(self, body: dict[str, Any], gen: dict[str, Any], fault: str | None) -> dict[str, Any]:
        ids, n_prompt = gen["ids"], len(gen["prompt_ids"])
        logprobs = self._logprobs(gen, 0, len(ids), fault)
        if not self.v32:  # 0.24: only request_id (a fresh random id), choices, prompt_logprobs, kv_transfer_params
            choice: dict[str, Any] = {
                "index": 0,
                "logprobs": logprobs,
                "finish_reason": gen["finish"],
                "token_ids": self._ids_with_fault(ids, fault),
                "routed_experts": self._routes(gen),
            }
            if fault == "missing_ids":
                del choice["token_ids"]
            return {
                "request_id": gen["request_id"],
                "choices": [choice],
                "prompt_logprobs": None,
                "kv_transfer_params": None,
            }
        choice = {
            "index": 0,
            "finish_reason": gen["finish"],
            "stop_reason": gen.get("stop_reason") if gen["finish"] == "stop" else None,
            "token_ids": self._ids_with_fault(ids, fault),
            "routed_experts": self._routes(gen),
            "sampling_mask": None,
            "weight_versions": self._weight_versions(gen),
            "logprobs": logprobs,
        }
        if fault == "missing_ids":
            del choice["token_ids"]
        return {
            "request_id": gen["request_id"],
            "model": body.get("model") or self.config.served_model_name,
            "created": int(time.time()),
            "usage": self._usage(n_prompt, len(ids)),
            "prompt_logprobs": None,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": self._echo(gen["prompt_ids"], fault) if body.get("return_token_ids") is True else None,
            "mm_placeholders": self._placeholders_echo(body, gen),
            "metrics": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "output_mode": "tokens",
            "choices": [choice],
        }

    @staticmethod
    def _placeholders_echo(body: dict[str, Any], gen: dict[str, Any]) -> dict[str, Any] | None:
        """0.30+ with `return_token_ids`: where each image's placeholders were in the prompt it ran on."""
        if body.get("return_token_ids") is not True or not gen["images"]:
            return None
        return {"image": [{"offset": i["offset"], "length": i["length"]} for i in gen["images"]]}

    def _weight_versions(self, gen: dict[str, Any]) -> list[dict[str, Any]] | None:
        """0.32's spans of the weights that sampled the output tokens: the label each token was stamped with as it
        was sampled (`EnginePause.step`); `previous_weight_version` instead says the weights changed halfway."""
        n = len(gen["ids"])
        if n == 0:
            return None
        now, before = self.config.weight_version, self.config.previous_weight_version
        if before is not None and n >= 2:
            return [{"version": before, "start": 0, "end": n // 2}, {"version": now, "start": n // 2, "end": n}]
        labels = gen["labels"]
        return spans_of(labels) if len(labels) == n else [{"version": now, "start": 0, "end": n}]

    async def produce(self, gen: dict[str, Any], generation: Generation) -> None:
        """Sample the planned tokens one step at a time, at the configured pace: a pause in `abort` mode (or an abort
        of this request) ends the generation with what it has, `finish_reason: "abort"`; a holding pause waits."""
        produced = 0
        for _ in gen["ids"]:
            if not await self.pause.step(generation, self.config.weight_version):
                break
            produced += 1
            if self.config.token_delay_s:
                await asyncio.sleep(self.config.token_delay_s)
        gen["labels"] = generation.labels
        if produced < len(gen["ids"]):
            self.cut(gen, produced)
        with self._lock:
            gen["entry"]["labels"] = list(generation.labels)

    def cut(self, gen: dict[str, Any], produced: int) -> None:
        """The generation was aborted after `produced` tokens: it answers with those, and its plan is kept."""
        self.pause.remember(gen["root"], gen["plan"])
        gen["ids"], gen["logprobs"], gen["finish"] = gen["ids"][:produced], gen["logprobs"][:produced], "abort"
        with self._lock:
            gen["entry"].update(completion_ids=gen["ids"], logprobs=gen["logprobs"])

    @staticmethod
    def _usage(prompt: int, completion: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }

    def _stream_event(
        self, body: dict[str, Any], gen: dict[str, Any], i: int, fault: str | None, final: bool
    ) -> dict[str, Any]:
        """0.32 SSE: one event per token (token `i`; none on an abort's terminal event, `i` == the tokens sampled);
        finish_reason, stop_reason and weight_versions on the final one."""
        ids = gen["ids"]
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": gen["finish"] if final else None,
            "stop_reason": gen.get("stop_reason") if final and gen["finish"] == "stop" else None,
            "token_ids": self._ids_with_fault(ids[i : i + 1], fault),
            "routed_experts": self._routes(gen) if final else None,  # 0.32: concatenated once the request finished
            "sampling_mask": None,
            "weight_versions": self._weight_versions(gen) if final else None,
            "logprobs": self._logprobs(gen, i, min(i + 1, len(ids)), fault),
        }
        if fault == "missing_ids":
            del choice["token_ids"]
        return {
            "request_id": gen["request_id"],
            "usage": None,
            "prompt_token_ids": list(gen["prompt_ids"]) if i == 0 and body.get("return_token_ids") is True else None,
            "mm_placeholders": self._placeholders_echo(body, gen) if i == 0 else None,
            "metrics": None,
            "output_mode": "tokens",
            "choices": [choice],
        }

    async def _stream_generate(
        self, request: web.Request, body: dict[str, Any], gen: dict[str, Any], fault: str | None, generation: Generation
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        delay = self.config.token_delay_s or self.config.stream_delay_s

        async def send(event: dict[str, Any]) -> None:
            await resp.write(f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode())

        try:
            planned = len(gen["ids"])
            produced = 0
            for i in range(planned):
                if not await self.pause.step(generation, self.config.weight_version):
                    break
                if fault == "cut_stream" and produced == max(planned // 2, 1):
                    if request.transport is not None:
                        request.transport.abort()  # the engine died: no finish, no [DONE]
                    self.cancelled_streams += 1
                    return resp
                produced += 1
                gen["labels"] = generation.labels
                await send(self._stream_event(body, gen, i, fault, final=i == planned - 1))
                if delay:
                    await asyncio.sleep(delay)
                if request.transport is None or request.transport.is_closing():
                    raise ConnectionResetError("client went away")
            with self._lock:
                gen["entry"]["labels"] = list(generation.labels)
            if produced < planned:  # aborted: vLLM still sends its terminal chunk, with no new tokens
                self.cut(gen, produced)
                await send(self._stream_event(body, gen, produced, fault, final=True))
            opts = body.get("stream_options")
            if isinstance(opts, dict) and opts.get("include_usage") is True:
                usage = self._usage(len(gen["prompt_ids"]), len(gen["ids"]))
                await send({
                    "request_id": gen["request_id"], "usage": usage, "prompt_token_ids": None,
                    "mm_placeholders": None, "metrics": None, "output_mode": "tokens", "choices": [],
                })  # fmt: skip
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            # vLLM aborts a generation whose client disconnected; count it so tests can see the cancel.
            self.cancelled_streams += 1
            return resp
        self.completed_streams += 1
        return resp
