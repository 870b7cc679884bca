"""vLLM's ``POST /inference/v1/generate``: generates from ``token_ids`` EXACTLY as given.

Generate has no messages: it decodes the prompt ids, recovers the Qwen3 conversation from the text and lets the
scripted model decide the completion, with its non-canonical splits. Answers in the version's shape (0.32: usage,
``weight_versions`` spans, integer-id logprobs, a per-token SSE stream; 0.24: a random ``request_id`` and
``"token_id:N"`` logprob placeholders), with the generate-only body faults applied.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from tito_addon.replicas.replica_tokenizer import noncanonical_ids
from tito_addon.replicas.scripted_model import completion_text, conversation_from_prompt, logprob, script_turn
from tito_addon.replicas.vllm_config import MAX_TOP_LOGPROBS, VllmEndpoint, bad_request, is_int


class GenerateEndpoint(VllmEndpoint):
    """The generate endpoint's model run, bodies and stream (the replica's ``_generate`` handler answers with them);
    counts the streams it completed and those whose client went away."""

    completed_streams: int
    cancelled_streams: int

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

        prompt_ids = [int(t) for t in ids]
        conv, thinking = conversation_from_prompt(tok.decode(prompt_ids))
        script = script_turn(conv, thinking, answer_sentences=self.config.answer_sentences)
        text, spans, fallback = completion_text(script)
        out, _ = noncanonical_ids(tok, text, spans, fallback, enabled=self.config.noncanonical)
        out.append(tok.im_end)
        finish = "stop"
        if len(out) > limit:
            out, finish = out[:limit], "length"
        rid = request.headers.get("X-Request-Id") or (
            body["request_id"] if isinstance(body.get("request_id"), str) and body["request_id"] else self._random_id()
        )
        return {
            "request_id": f"generate-tokens-{rid}" if self.v32 else uuid.uuid4().hex,
            "prompt_ids": prompt_ids,
            "ids": out,
            "logprobs": [logprob(i, t) for i, t in enumerate(out)],
            "finish": finish,
            "top_k": None if k is None else (MAX_TOP_LOGPROBS if k == -1 else min(k, MAX_TOP_LOGPROBS)),
        }

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
                "routed_experts": None,
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
            "stop_reason": None,
            "token_ids": self._ids_with_fault(ids, fault),
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": self._weight_versions(len(ids)),
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
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "output_mode": "tokens",
            "choices": [choice],
        }

    def _weight_versions(self, n: int) -> list[dict[str, Any]]:
        """0.32's spans of the weights that sampled `n` output tokens."""
        now, before = self.config.weight_version, self.config.previous_weight_version
        if before is None or n < 2:
            return [{"version": now, "start": 0, "end": n}]
        return [{"version": before, "start": 0, "end": n // 2}, {"version": now, "start": n // 2, "end": n}]

    @staticmethod
    def _usage(prompt: int, completion: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }

    def _stream_events(self, body: dict[str, Any], gen: dict[str, Any], fault: str | None) -> Iterator[dict[str, Any]]:
        """0.32 SSE: one event per token; finish_reason/stop_reason/weight_versions on the last one."""
        ids = gen["ids"]
        n = len(ids)
        for i, tid in enumerate(ids):
            last = i == n - 1
            choice: dict[str, Any] = {
                "index": 0,
                "finish_reason": gen["finish"] if last else None,
                "stop_reason": None,
                "token_ids": self._ids_with_fault([tid], fault),
                "routed_experts": None,
                "sampling_mask": None,
                "weight_versions": self._weight_versions(n) if last else None,
                "logprobs": self._logprobs(gen, i, i + 1, fault),
            }
            if fault == "missing_ids":
                del choice["token_ids"]
            yield {
                "request_id": gen["request_id"],
                "usage": None,
                "prompt_token_ids": list(gen["prompt_ids"])
                if i == 0 and body.get("return_token_ids") is True
                else None,
                "mm_placeholders": None,
                "metrics": None,
                "output_mode": "tokens",
                "choices": [choice],
            }
        opts = body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage") is True:
            yield {
                "request_id": gen["request_id"],
                "usage": self._usage(len(gen["prompt_ids"]), n),
                "prompt_token_ids": None,
                "mm_placeholders": None,
                "metrics": None,
                "output_mode": "tokens",
                "choices": [],
            }

    async def _stream_generate(
        self, request: web.Request, body: dict[str, Any], gen: dict[str, Any], fault: str | None
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        try:
            for event in self._stream_events(body, gen, fault):
                await resp.write(f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode())
                if self.config.stream_delay_s:
                    await asyncio.sleep(self.config.stream_delay_s)
                if request.transport is None or request.transport.is_closing():
                    raise ConnectionResetError("client went away")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            # vLLM aborts a generation whose client disconnected; count it so tests can see the cancel.
            self.cancelled_streams += 1
            return resp
        self.completed_streams += 1
        return resp
