"""The engine routers the tests and benchmarks run in front of several engines, from their PyPI wheels (Rust binaries
installed beside this Python): vllm-router and smg (the sglang model gateway). Each is a `LoggedServer` on loopback with
health checks every second and an engine out after two failures; what a test asks of one is which engines it routes to,
and to add or remove one through the router's own API."""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from tito_addon.replicas.fleet import LoggedServer, free_port


class EngineRouter(LoggedServer):
    """A router in front of engines: what a test asks of it (which engines it routes to; add and remove one)."""

    engines: list[str]  # the engines it was started with

    def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            request.add_header("content-type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                raw = answer.read()
                status = answer.status
        except urllib.error.HTTPError as error:
            raw, status = error.read(), error.code
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    def start(self, timeout: float = 30.0) -> Self:
        """Started once it routes to every engine it was given: a router listens before it has read its engines'
        facts and health (smg answers 404 until then), and a test's first request must not race that."""
        super().start(timeout)
        try:
            self._wait(lambda: set(self.engines) <= set(self.engines_routed()), timeout, "not every engine joined")
        except TimeoutError as exc:
            self.stop()
            raise RuntimeError(f"{exc}\n{self.output()}") from exc
        return self

    def engines_routed(self) -> list[str]:
        raise NotImplementedError

    def add_engine(self, url: str, timeout: float = 30.0) -> None:
        raise NotImplementedError

    def remove_engine(self, url: str, timeout: float = 30.0) -> None:
        raise NotImplementedError

    def _wait(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: the router's engines are {self.engines_routed()}")
            time.sleep(0.1)


class VllmRouter(EngineRouter):
    """`vllm-router` (the PyPI wheel's binary, beside this Python) in front of `engines` with a session `policy`;
    health checks every second, an engine out after two failures."""

    def __init__(self, engines: list[str], policy: str = "consistent_hash", port: int | None = None) -> None:
        super().__init__(port, "vllm-router")
        self.engines = list(engines)
        self.policy = policy
        self.executable = str(Path(sys.executable).with_name("vllm-router"))

    def argv(self) -> list[str]:
        argv = [self.executable, "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *self.engines]
        argv += ["--policy", self.policy, "--health-check-interval-secs", "1", "--health-failure-threshold", "2"]
        # Its metrics listener defaults to port 29000: a port of its own, or two routers on one machine collide.
        argv += ["--prometheus-port", str(free_port())]
        return [*argv, "--log-level", "warning"]

    def engines_routed(self) -> list[str]:
        status, body = self._call("GET", "/list_workers")
        return list(body.get("urls", [])) if status == 200 and isinstance(body, dict) else []

    def add_engine(self, url: str, timeout: float = 30.0) -> None:
        """`POST /add_worker?url=`: synchronous, once the engine answers its health check."""
        status, body = self._call("POST", "/add_worker?url=" + urllib.parse.quote(url, safe=""))
        if status != 200:
            raise RuntimeError(f"vllm-router refused to add {url}: {status} {body}")
        self._wait(lambda: url in self.engines_routed(), timeout, f"{url} was not added")

    def remove_engine(self, url: str, timeout: float = 30.0) -> None:
        status, body = self._call("POST", "/remove_worker?url=" + urllib.parse.quote(url, safe=""))
        if status != 200:
            raise RuntimeError(f"vllm-router refused to remove {url}: {status} {body}")
        self._wait(lambda: url not in self.engines_routed(), timeout, f"{url} was not removed")


class SmgGateway(EngineRouter):
    """`smg` (the sglang model gateway, PyPI 1.x; its binary beside this Python) in front of `engines` with a session
    `policy` (`manual` or `consistent_hashing`, keyed by `X-SMG-Routing-Key`); health checks every second, an engine
    out after two failures."""

    def __init__(self, engines: list[str], policy: str = "manual", port: int | None = None) -> None:
        super().__init__(port, "smg")
        self.engines = list(engines)
        self.policy = policy
        self.executable = str(Path(sys.executable).with_name("smg"))

    def argv(self) -> list[str]:
        argv = [self.executable, "launch", "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls"]
        argv += [*self.engines, "--policy", self.policy, "--health-check-interval-secs", "1"]
        argv += ["--health-failure-threshold", "2", "--disable-tokenizer-autoload"]
        # Its metrics listener defaults to 0.0.0.0:29000: loopback and a port of its own.
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        return [*argv, "--log-level", "warn"]

    def _workers(self) -> list[dict]:
        status, body = self._call("GET", "/workers")
        workers = body.get("workers") if status == 200 and isinstance(body, dict) else None
        return [w for w in workers if isinstance(w, dict)] if isinstance(workers, list) else []

    def engines_routed(self) -> list[str]:
        """The engines smg routes to: those it lists as healthy."""
        return [w["url"] for w in self._workers() if w.get("is_healthy") and w.get("status", "ready") == "ready"]

    def add_engine(self, url: str, timeout: float = 30.0) -> None:
        """`POST /workers {"url"}`: 202, the engine joins once smg has read its facts and health."""
        status, body = self._call("POST", "/workers", {"url": url})
        if status not in (200, 201, 202):
            raise RuntimeError(f"smg refused to add {url}: {status} {body}")
        self._wait(lambda: url in self.engines_routed(), timeout, f"{url} was not added")

    def remove_engine(self, url: str, timeout: float = 30.0) -> None:
        """`DELETE /workers/{id}`: 202, applied in the background."""
        (worker,) = [w for w in self._workers() if w.get("url") == url]
        status, body = self._call("DELETE", f"/workers/{worker['id']}")
        if status not in (200, 202, 204):
            raise RuntimeError(f"smg refused to remove {url}: {status} {body}")
        self._wait(lambda: all(w.get("url") != url for w in self._workers()), timeout, f"{url} was not removed")
