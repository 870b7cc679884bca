"""How a replica is served: an aiohttp app bound on loopback, on its own event loop in a thread for sync tests.

:class:`ServedApp` is what both replicas are (an app plus a stop that also releases handlers stalled on purpose);
:class:`BackendThread` runs one in a daemon thread (each replica's ``*Thread`` says which, and from what config);
:func:`json_response` is the JSON body both answer with.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Self, TypeVar

from aiohttp import web

T = TypeVar("T")


def json_response(obj: Any, status: int = 200) -> web.Response:
    text = json.dumps(obj, ensure_ascii=False, allow_nan=True)
    return web.Response(status=status, text=text, content_type="application/json", charset="utf-8")


class ServedApp:
    """An aiohttp app bound on loopback, with a stop that also releases handlers stalled on purpose."""

    app: web.Application
    _stopping: asyncio.Event | None = None
    _runner: web.AppRunner | None = None
    port: int | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Bind and serve; returns the bound port."""
        self._stopping = asyncio.Event()
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        # uvicorn's default backlog, which sglang and vLLM serve with: aiohttp's 128 overflows when a thousand agents'
        # turns open their connections at once, and a connection the kernel drops there is reset on its first byte.
        site = web.TCPSite(self._runner, host, port, backlog=2048)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()  # releases stalled handlers
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def kill(self) -> None:
        """Die as a killed engine does: every open connection reset at once, answers in flight left unfinished (`stop`
        lets them end first)."""
        server = self._runner.server if self._runner is not None else None
        for handler in list(server.connections) if server is not None else []:
            if handler.transport is not None:
                handler.transport.abort()
        await self.stop()


async def serve_until_stopped(backend: ServedApp, host: str, port: int, port_file: str | None) -> None:
    """A replica as a server process (`python -m tito_addon reference-backend`): bound, its URL printed (and its port
    written to `port_file`), served until SIGTERM or SIGINT, then stopped."""
    bound = await backend.start(host, port)
    shown = f"[{host}]" if ":" in host else host
    print(f"reference backend listening on http://{shown}:{bound}", flush=True)
    if port_file:
        tmp = Path(port_file + ".tmp")
        tmp.write_text(f"{bound}\n")
        os.replace(tmp, port_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-main thread / Windows
            pass
    try:
        await stop.wait()
    finally:
        await backend.stop()


class BackendThread:
    """Run a replica (a :class:`ServedApp`) on its own event loop in a daemon thread.

    A subclass says which replica from which config (``_coerce_config``, ``_make_backend``) and names its thread.
    Surface: context manager, ``.url``, ``.backend``, ``.received()``, ``.generated()``, ``.set_faults()``,
    ``.clear()``.
    """

    def __init__(self, config: Any, host: str = "127.0.0.1", port: int = 0, start_timeout: float = 60.0) -> None:
        self.config = self._coerce_config(config)
        self.host = host
        self._want_port = port
        self._start_timeout = start_timeout
        self.backend = self._make_backend(self.config)
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    #: name of the background thread
    thread_name = "replica"

    @staticmethod
    def _coerce_config(config: Any) -> Any:
        """The replica's config, from a config or a tokenizer path."""
        raise NotImplementedError

    def _make_backend(self, config: Any) -> Any:
        """The backend to serve; it needs start/stop, received_copy, generated_copy, set_faults, reset."""
        raise NotImplementedError

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("replica not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> Self:
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()
        if not self._ready.wait(self._start_timeout):
            raise RuntimeError("reference backend did not start in time")
        if self._error is not None:
            raise RuntimeError(f"reference backend failed to start: {self._error!r}") from self._error
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            self.port = loop.run_until_complete(self.backend.start(self.host, self._want_port))
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self.backend.stop())
            # Handlers a kill left waiting (on a pause, a stall) end here, not as "Task was destroyed" at close.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        self._thread = None
        self._loop = None

    def kill(self) -> None:
        """The engine dies: its connections reset, nothing in flight answered (`ServedApp.kill`); then stopped."""
        if self._loop is not None:
            self.on_loop(self.backend.kill())
        self.stop()

    def on_loop(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the replica's own loop and wait for it: what a test does to the engine when its HTTP
        routes are out of reach (a replica in another network namespace)."""
        if self._loop is None:
            coroutine.close()
            raise RuntimeError("replica not started")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=120)

    def received(self) -> list[dict[str, Any]]:
        return self.backend.received_copy()

    def generated(self) -> list[dict[str, Any]]:
        return self.backend.generated_copy()

    def set_faults(self, faults: list[str]) -> None:
        self.backend.set_faults(faults)

    def clear(self) -> None:
        self.backend.reset()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
