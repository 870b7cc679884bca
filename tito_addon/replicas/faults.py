"""Transport faults both replicas inject: a server that stalls, hangs up, or answers with a body that is not JSON.

Each replica keeps its own fault queue and vocabulary (``FAULT_NAMES`` for sglang, ``VLLM_FAULTS`` for vLLM) and its
own error bodies for ``http<NNN>``; what they share is how a connection misbehaves, here.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

#: Faults that never reach the model: the answer is a broken transport or a broken body.
TRANSPORT_FAULTS = frozenset({"reset", "reset_early", "stall", "not_json", "truncated_json"})

#: A complete HTTP 200 whose JSON body stops mid-completion (a proxy or server that cut the body it framed).
_TRUNCATED_COMPLETION = (
    b'{"id": "cut", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", '
    b'"content": "Par'
)


async def _reset_before_answering(request: web.Request) -> web.StreamResponse:
    """``reset_early``: close the connection before a single byte of the answer (a crashed or restarted server)."""
    if request.transport is not None:
        request.transport.abort()
    return web.Response(status=500)  # never sent: the connection is gone


async def _stall_or_reset(request: web.Request, fault: str, stopping: asyncio.Event | None) -> web.StreamResponse:
    """``stall``: hold the request until shutdown (or an hour); then (and for ``reset``) send
    response headers plus a few bytes of a JSON body and abort the connection."""
    if fault == "stall" and stopping is not None:
        try:
            await asyncio.wait_for(stopping.wait(), timeout=3600)
        except TimeoutError:
            pass
    resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json", "Content-Length": "4096"})
    transport = request.transport
    try:
        if transport is not None and not transport.is_closing():
            await resp.prepare(request)
            await resp.write(b'{"id": "')
    except ConnectionError:  # the client already went away
        pass
    if transport is not None:
        transport.abort()
    return resp


async def answer_transport_fault(
    request: web.Request, fault: str, stopping: asyncio.Event | None
) -> web.StreamResponse:
    """The answer to one of :data:`TRANSPORT_FAULTS`; ``stopping`` releases a stalled request at shutdown."""
    if fault == "not_json":
        return web.Response(status=200, body=b"{weird", content_type="application/json")
    if fault == "truncated_json":
        return web.Response(status=200, body=_TRUNCATED_COMPLETION, content_type="application/json")
    if fault == "reset_early":
        return await _reset_before_answering(request)
    # "stall" / "reset": headers out, then abort the connection
    return await _stall_or_reset(request, fault, stopping)
