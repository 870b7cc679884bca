"""sglang's answer bodies, from one :class:`~tito_addon.replicas.sglang_generation.Generation`: the chat completion
(``prompt_token_ids``, ``response_token_ids``, ``meta_info`` with logprobs, ``sglext`` ids), the body faults, and the
stream (its chunks, the ``sglext_ids`` event, usage). :class:`SglangBodies` is mixed into
:class:`~tito_addon.replicas.sglang_replica.ReferenceBackend`, whose config and tokenizer it reads.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from tito_addon.replicas.engine_pause import spans_of
from tito_addon.replicas.expert_routing import route_rows, sglang_routes_b64
from tito_addon.replicas.replica_tokenizer import ReplicaTokenizer
from tito_addon.replicas.sglang_config import ReplicaConfig
from tito_addon.replicas.sglang_generation import Generation, truthy


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


class SglangBodies:
    """The response shapes of the sglang replica (mixed into it: reads its ``config`` and ``tokenizer``)."""

    config: ReplicaConfig
    tokenizer: ReplicaTokenizer

    cut: Callable[[dict[str, Any], Generation, int], None]  # (SglangGeneration's: an abort after N tokens)

    def _logprob_entries(self, gen: Generation, lo: int, hi: int, top_n: int) -> list[dict[str, Any]]:
        entries = []
        for i in range(lo, hi):
            text, lp = gen.token_texts[i], gen.logprobs[i]
            top: list[dict[str, Any]] = []
            if top_n > 0:
                top.append({"token": text, "bytes": list(text.encode("utf-8")), "logprob": lp})
                for j in range(1, top_n):
                    alt = self.tokenizer.token_texts([(gen.completion_ids[i] + 7919 * j) % self.tokenizer.first_added])[
                        0
                    ]
                    top.append({"token": alt, "bytes": list(alt.encode("utf-8")), "logprob": round(lp - 1.5 * j, 6)})
            entries.append({"token": text, "bytes": list(text.encode("utf-8")), "logprob": lp, "top_logprobs": top})
        return entries

    def _meta_info(self, body: dict[str, Any], gen: Generation, with_logprobs: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": gen.rid,
            "finish_reason": dict(gen.finish),
            "prompt_tokens": len(gen.prompt_ids),
            "weight_version": self.config.weight_version,
            "completion_tokens": len(gen.completion_ids),
            "cached_tokens": gen.cached_tokens,
            "reasoning_tokens": gen.reasoning_tokens,
            "e2e_latency": gen.e2e_latency,
        }
        if len(gen.labels) == len(gen.completion_ids) and gen.completion_ids:
            # 0.5.20+: the label of each token's weights, as spans; the turn's version is the last span's.
            spans = spans_of(gen.labels)
            meta["weight_version"] = spans[-1]["version"]
            if _version_tuple(self.config.version) >= (0, 5, 20):
                meta["weight_versions"] = spans
        if with_logprobs:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [
                [lp, tid, txt] for lp, tid, txt in zip(gen.logprobs, gen.completion_ids, gen.token_texts, strict=True)
            ]
            meta["output_token_logprobs_length"] = len(gen.completion_ids)
        return meta

    def _usage(self, gen: Generation) -> dict[str, Any]:
        n, m = len(gen.prompt_ids), len(gen.completion_ids)
        return {
            "prompt_tokens": n,
            "completion_tokens": m,
            "total_tokens": n + m,
            "reasoning_tokens": gen.reasoning_tokens,
        }

    def _tool_calls_json(self, gen: Generation) -> list[dict[str, Any]] | None:
        if not gen.parsed.tool_calls:
            return None
        return [
            {"id": cid, "index": i, "type": "function", "function": {"name": name, "arguments": args}}
            for i, (cid, (name, args)) in enumerate(zip(gen.tool_call_ids, gen.parsed.tool_calls, strict=True))
        ]

    def _sglext_flags(self, body: dict[str, Any], request: web.Request) -> tuple[bool, bool]:
        if not self.config.honor_input_ids or _version_tuple(self.config.version) < (0, 5, 20):
            return False, False  # sglext ids arrived in 0.5.20
        want_in = (
            truthy(body.get("return_input_ids_in_sglext")) or request.headers.get("x-sglext-return-input-ids") == "1"
        )
        want_out = (
            truthy(body.get("return_output_ids_in_sglext")) or request.headers.get("x-sglext-return-output-ids") == "1"
        )
        return want_in, want_out

    def _sglext(self, body: dict[str, Any], request: web.Request, gen: Generation) -> dict[str, Any]:
        """The sglext ids block the request asked for (0.5.20+), or {} when it asked for none."""
        want_in, want_out = self._sglext_flags(body, request)
        ext: dict[str, Any] = {}
        if want_in:
            ext["input_ids"] = list(gen.prompt_ids)
        if want_out:
            ext["output_ids"] = [list(gen.completion_ids)]
        return ext

    def _routes(self, body: dict[str, Any], gen: Generation) -> str | None:
        """The routed experts the answer carries (rows `[routed_experts_start_len, seqlen - 1)` over the prompt and the
        output ids, as base64 int32; `""` when there are none), or None: the server flag off or none asked for. An
        older server (`honor_input_ids` off) has no start on chat and returns every row."""
        if not self.config.routed_experts or not truthy(body.get("return_routed_experts")):
            return None
        start = body.get("routed_experts_start_len", 0) if self.config.honor_input_ids else 0
        return sglang_routes_b64(route_rows(self.config, gen.prompt_ids + gen.completion_ids, start))

    def _response_body(self, body: dict[str, Any], gen: Generation, request: web.Request) -> dict[str, Any]:
        honor = self.config.honor_input_ids
        want_logprobs = truthy(body.get("logprobs"))
        top_n = body.get("top_logprobs") if isinstance(body.get("top_logprobs"), int) else 0
        choice: dict[str, Any] = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": gen.parsed.content,
                "reasoning_content": gen.parsed.reasoning,
                "tool_calls": self._tool_calls_json(gen),
            },
            "logprobs": {"content": self._logprob_entries(gen, 0, len(gen.completion_ids), top_n)}
            if want_logprobs
            else None,
            "finish_reason": gen.finish["type"],
            "matched_stop": gen.finish.get("matched"),
        }
        want_token_ids = honor and truthy(body.get("return_token_ids"))
        if honor and (truthy(body.get("return_prompt_token_ids")) or want_token_ids):
            choice["prompt_token_ids"] = list(gen.prompt_ids)
        if want_token_ids:
            choice["response_token_ids"] = list(gen.completion_ids)
        routes = self._routes(body, gen)
        if honor and truthy(body.get("return_meta_info")):
            choice["meta_info"] = self._meta_info(body, gen, want_logprobs)
            if routes is not None:  # 0.5.23: then only here, never in sglext
                choice["meta_info"]["routed_experts"] = routes
                routes = None
        out: dict[str, Any] = {
            "id": gen.rid,
            "object": "chat.completion",
            "created": gen.created,
            "model": gen.model,
            "choices": [choice],
            "usage": self._usage(gen),
            "metadata": {"weight_version": self.config.weight_version},
        }
        ext = self._sglext(body, request, gen)
        if routes:  # SglExt's first field; an empty string (no rows) leaves it out, as sglang's truth test does
            ext = {"routed_experts": routes, **ext}
        if ext:
            out["sglext"] = ext
        return out

    def _apply_body_fault(self, out: dict[str, Any], gen: Generation, fault: str) -> None:
        choice = out["choices"][0]
        if fault == "no_choices":
            out["choices"] = []
        elif fault == "no_meta_info":
            choice["meta_info"] = None
        elif fault == "empty_message":
            choice["message"].update({"content": None, "reasoning_content": None, "tool_calls": None})
        elif fault == "wrong_prompt_ids":
            ids = list(gen.prompt_ids)
            ids[-1] = ids[-1] + 1 if ids[-1] + 1 < self.tokenizer.size else ids[-1] - 1
            choice["prompt_token_ids"] = ids
        elif fault == "wrong_prompt_tokens":  # counted another prompt than it was sent, and did not echo it
            choice["meta_info"]["prompt_tokens"] += 1
            out["usage"]["prompt_tokens"] += 1
        elif fault in ("length_mismatch", "nan_logprob"):
            meta = choice.get("meta_info")
            if not isinstance(meta, dict) or "output_token_logprobs" not in meta:
                meta = self._meta_info({}, gen, with_logprobs=True)
                choice["meta_info"] = meta
            lps = meta["output_token_logprobs"]
            if fault == "length_mismatch":
                del lps[-1]
            else:
                lps[len(lps) // 2][0] = math.nan

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        gen: Generation,
        fault: str | None = None,
        step: Callable[[], Awaitable[bool]] | None = None,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        framed = request.headers.get("x-sglext-ids-framed") == "1"
        async for event in self._stream_events(body, gen, request, fault, step):
            if isinstance(event, tuple):
                name, payload = event
                data = (
                    f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"
                    if framed
                    else f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
                )
            else:
                data = f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
            await resp.write(data.encode("utf-8"))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _stream_abort(self, request: web.Request, message: str) -> web.StreamResponse:
        """A streamed request the scheduler aborted with an error (status 400): sglang has already answered 200, so
        its stream holds one error chunk, in its streaming error shape, then `[DONE]`."""
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        error = {"object": "error", "message": message, "type": "BAD_REQUEST", "param": None, "code": 400}
        await resp.write(f"data: {json.dumps({'error': error}, ensure_ascii=False)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp

    async def _stream_events(
        self,
        body: dict[str, Any],
        gen: Generation,
        request: web.Request,
        fault: str | None = None,
        step: Callable[[], Awaitable[bool]] | None = None,
    ) -> AsyncIterator[dict[str, Any] | tuple[str, dict[str, Any]]]:
        """The stream's events; of the body faults, a stream has the two about its prompt (ids echoed wrong in the
        sglext block, or a prompt length counted wrong in the usage chunk). `step` is asked before each token: once
        it says no (an abort), the stream ends as sglang ends a graceful abort, with the tokens it has: a finish
        chunk `abort`, then the sglext block with every id sampled."""
        want_logprobs = truthy(body.get("logprobs"))
        top_n = body.get("top_logprobs") if isinstance(body.get("top_logprobs"), int) else 0

        def chunk(
            delta: dict[str, Any], lo: int = 0, hi: int = 0, finish: dict[str, Any] | None = None
        ) -> dict[str, Any]:
            c: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": {"content": self._logprob_entries(gen, lo, hi, top_n)}
                if want_logprobs and hi > lo
                else None,
                "finish_reason": finish["type"] if finish else None,
                "matched_stop": finish.get("matched") if finish else None,
            }
            return {
                "id": gen.rid,
                "object": "chat.completion.chunk",
                "created": gen.created,
                "model": gen.model,
                "choices": [c],
            }

        yield chunk({"role": "assistant", "content": ""})
        p = gen.parsed
        text = gen.text
        stop_token = gen.finish["type"] != "length" and not isinstance(gen.finish.get("matched"), str)
        n_text = len(gen.completion_ids) - (1 if stop_token else 0)
        lp_from, prev = 0, 0
        call_ids = self._tool_calls_json(gen) or []
        next_call = 0
        for i in range(n_text):
            if step is not None and not await step():
                self.cut(body, gen, i)
                break
            cur = self.tokenizer.decode(gen.completion_ids[: i + 1])
            cur_len = len(os.path.commonprefix([cur, text]))
            if cur_len <= prev and not (i == n_text - 1):
                continue
            out: list[dict[str, Any]] = []
            for key, span in (("reasoning_content", p.reasoning_span), ("content", p.content_span)):
                if span is not None:
                    lo, hi = max(prev, span[0]), min(cur_len, span[1])
                    if hi > lo:
                        out.append({key: text[lo:hi]})
            while next_call < len(p.call_ends) and p.call_ends[next_call] <= cur_len:
                tc = call_ids[next_call]
                out.append(
                    {
                        "tool_calls": [
                            {
                                "index": tc["index"],
                                "id": tc["id"],
                                "type": "function",
                                "function": {"name": tc["function"]["name"], "arguments": ""},
                            }
                        ]
                    }
                )
                out.append(
                    {"tool_calls": [{"index": tc["index"], "function": {"arguments": tc["function"]["arguments"]}}]}
                )
                next_call += 1
            prev = max(prev, cur_len)
            for k, delta in enumerate(out):
                if k == 0:
                    yield chunk(delta, lp_from, i + 1)
                    lp_from = i + 1
                else:
                    yield chunk(delta)
        if step is not None and len(gen.completion_ids) > n_text and not await step():  # the stop token's step
            self.cut(body, gen, n_text)
        yield chunk({}, lp_from, len(gen.completion_ids), finish=gen.finish)
        ext = self._sglext(body, request, gen)
        if fault == "wrong_prompt_ids" and "input_ids" in ext:
            ids = ext["input_ids"]
            ids[-1] = ids[-1] + 1 if ids[-1] + 1 < self.tokenizer.size else ids[-1] - 1
        # The routes (known once the request finished) ride in the sglext chunk, with the ids; framed, sglang splits
        # that chunk: the routes in a plain data chunk, then the ids in their `sglext_ids` event.
        routes = self._routes(body, gen)
        ext_chunk = {"id": gen.rid, "object": "chat.completion.chunk", "created": gen.created, "model": gen.model,
                     "choices": []}  # fmt: skip
        if routes is not None and request.headers.get("x-sglext-ids-framed") == "1":
            yield {**ext_chunk, "sglext": {"routed_experts": routes}}
        elif routes is not None:
            ext = {"routed_experts": routes, **ext}
        if ext:
            yield ("sglext_ids", {**ext_chunk, "sglext": ext})
        opts = body.get("stream_options")
        if isinstance(opts, dict) and truthy(opts.get("include_usage")):
            usage = self._usage(gen)
            if fault == "wrong_prompt_tokens":
                usage["prompt_tokens"] += 1
            yield {
                "id": gen.rid,
                "object": "chat.completion.chunk",
                "created": gen.created,
                "model": gen.model,
                "choices": [],
                "usage": usage,
            }
