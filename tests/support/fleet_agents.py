"""A load generator for a proxy fleet: N concurrent tool-using agents on the openai SDK (AsyncOpenAI).

Agents come in GRPO groups of `GROUP`: the agents of a group send the same first request (same messages, tools and
temperature), each with its own `seed`, which is what makes the sglang replica's samples differ (it ignores the
temperature; see `_script_turn`). Every follow-up appends, to the agent's own history, the assistant message as
the SDK returned it and then either the tool results for its calls or a user message. Plans (by agent index):
some agents retry a turn (the same messages sent again, with a new seed as a sampling client's retry would; the
agent continues from the second answer), some edit what they appended (a follow-up, then the same follow-up with
the appended message changed; the agent continues from the second). `named=True` sends `x-session-id: <agent>`.

Every request carries a unique `x-request-id` and a unique seed. Each request is logged as an `Exchange`: its id,
final status, every HTTP status seen for it (an httpx response hook sees the SDK's own retries too), the proxy's
`x-tito-session-id`/`x-tito-turn-id`, the completion, and the exchange its history continues (`parent`).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import openai

try:  # the openai SDK's HTTP client: httpx, or its successor httpx2 in newer SDKs
    import httpx2 as httpx
except ImportError:  # pragma: no cover - depends on the installed SDK
    import httpx

from .basics import TOOLS  # noqa: E402 - the tool set every test's conversation uses

GROUP = 8
MODEL = "reference-model"
RETRYABLE = (502, 503, 504)
CITIES = ("Paris", "Tokyo", "Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Quito")


@dataclass
class Exchange:
    """One request as the agent saw it."""

    agent: str
    request_id: str
    seed: int
    kind: str  # first | follow | retry | edit
    parent: Exchange | None  # the exchange whose answer the request's history ends with
    status: int | None = None
    statuses: list[int] = field(default_factory=list)  # every HTTP answer, the SDK's retries and ours included
    error_bodies: list[tuple[int, str]] = field(default_factory=list)  # (status, body) of the 5xx answers
    session_id: str | None = None
    turn_id: int | None = None
    message: dict[str, Any] | None = None
    used: bool = False  # the agent continued from this answer

    @property
    def key(self) -> tuple[str, int]:
        assert self.session_id is not None and self.turn_id is not None
        return self.session_id, self.turn_id


class FleetAgent:
    """One agent: `turns` steps, each one request plus possibly a retry or an edit."""

    def __init__(self, run: FleetRun, index: int) -> None:
        self.run = run
        self.index = index
        self.group = index // GROUP
        self.name = f"{run.tag}-a{index:04d}"
        # plan: 0 plain, 1 retries one turn, 2 edits one follow-up, 3 both (at different steps)
        self.plan = index % 4
        self.retry_step = index % run.turns if run.turns else 0
        self.edit_step = 1 + (index * 7) % max(1, run.turns - 1)
        city = CITIES[self.group % len(CITIES)]
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": f"You are a weather agent. Run {run.tag}, group {self.group}."},
            {"role": "user", "content": f"What is the weather in {city} for group {self.group}?"},
        ]
        self.exchanges: list[Exchange] = []
        self.last: Exchange | None = None  # the exchange the history ends with

    def used_chain(self) -> list[Exchange]:
        return [x for x in self.exchanges if x.used]

    def _appended(self, message: dict[str, Any], step: int) -> list[dict[str, Any]]:
        calls = message.get("tool_calls") or []
        if calls:
            return [
                {"role": "tool", "tool_call_id": call["id"], "content": f"{self.name} step {step} call {k}: 21 C, dry"}
                for k, call in enumerate(calls)
            ]
        return [{"role": "user", "content": f"Thanks. And tomorrow, step {step}, for {self.name}?"}]

    @staticmethod
    def _edited(appended: list[dict[str, Any]]) -> list[dict[str, Any]]:
        last = dict(appended[-1])
        last["content"] = str(last["content"]) + " (edited: actually 19 C)"
        return [*appended[:-1], last]

    async def step(self, step: int) -> None:
        request, kind = list(self.messages), "first" if step == 0 else "follow"
        answer = await self.run.ask(self, request, kind, self.last)
        if self.plan in (1, 3) and step == self.retry_step:
            answer = await self.run.ask(self, request, "retry", self.last)
        if self.plan in (2, 3) and step == self.edit_step and step > 0:
            assert self.last is not None and self.last.message is not None
            base = len(self.messages) - self._appended_count
            edited = [*self.messages[:base], *self._edited(self.messages[base:])]
            answer = await self.run.ask(self, edited, "edit", self.last)
            request = edited
        answer.used = True
        self.last = answer
        assert answer.message is not None
        appended = self._appended(answer.message, step)
        self._appended_count = len(appended)
        self.messages = [*request, answer.message, *appended]

    _appended_count = 1


class FleetRun:
    """`agents` agents of `turns` steps against `base_url` (an OpenAI-compatible root, e.g. HAProxy's url + "/v1").

    `max_retries` is the SDK's own retry count; on top of it, a 502/503/504 that the SDK gives up on (or every one,
    with `max_retries=0`) is retried by our loop with backoff until `deadline_s`, always with the same request id.
    """

    def __init__(
        self,
        base_url: str,
        agents: int,
        turns: int,
        *,
        named: bool = False,
        max_retries: int = 3,
        tag: str | None = None,
        deadline_s: float = 600.0,
        api_key: str = "sk-agent",
    ) -> None:
        self.base_url = base_url
        self.turns = turns
        self.named = named
        self.max_retries = max_retries
        self.tag = tag or uuid.uuid4().hex[:8]
        self.deadline_s = deadline_s
        self.api_key = api_key
        self.agents = [FleetAgent(self, i) for i in range(agents)]
        self.by_request: dict[str, Exchange] = {}
        self.status_counts: Counter[int] = Counter()
        self.connection_errors = 0  # requests that got no HTTP answer at all (e.g. their proxy was killed)
        self.completed = 0  # 200s so far
        self.wall_s = 0.0
        self._seed = 0
        self._client: openai.AsyncOpenAI | None = None

    @property
    def exchanges(self) -> list[Exchange]:
        return [x for agent in self.agents for x in agent.exchanges]

    def total_requests(self) -> int:
        """How many requests a complete run sends (each agent: one per step, plus its retry and edit)."""
        extra = sum((a.plan in (1, 3)) + (a.plan in (2, 3) and self.turns > 1) for a in self.agents)
        return len(self.agents) * self.turns + extra

    async def _on_response(self, response: Any) -> None:
        request_id = response.request.headers.get("x-request-id")
        exchange = self.by_request.get(request_id or "")
        self.status_counts[response.status_code] += 1
        if exchange is None:
            return
        exchange.statuses.append(response.status_code)
        if response.status_code >= 500:
            await response.aread()
            exchange.error_bodies.append((response.status_code, response.text[:500]))

    async def ask(
        self, agent: FleetAgent, messages: list[dict[str, Any]], kind: str, parent: Exchange | None
    ) -> Exchange:
        assert self._client is not None
        self._seed += 1
        exchange = Exchange(agent.name, f"{self.tag}-r{uuid.uuid4().hex}", self._seed, kind, parent)
        self.by_request[exchange.request_id] = exchange
        agent.exchanges.append(exchange)
        headers = {"x-request-id": exchange.request_id}
        if self.named:
            headers["x-session-id"] = agent.name
        deadline = time.monotonic() + self.deadline_s
        delay = 0.2
        while True:
            try:
                raw = await self._client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=messages, tools=TOOLS, temperature=0.8, seed=exchange.seed,
                    extra_headers=headers,
                )  # fmt: skip
                break
            except openai.APIStatusError as exc:
                if exc.status_code not in RETRYABLE or time.monotonic() > deadline:
                    exchange.status = exc.status_code
                    raise
            except openai.APIConnectionError:
                self.connection_errors += 1
                if time.monotonic() > deadline:
                    raise
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 2.0)
        exchange.status = raw.status_code
        exchange.session_id = raw.headers.get("x-tito-session-id")
        turn = raw.headers.get("x-tito-turn-id")
        exchange.turn_id = int(turn) if turn is not None else None
        completion = raw.parse()
        exchange.message = completion.choices[0].message.model_dump(exclude_none=True)
        self.completed += 1
        return exchange

    async def run(self, chaos: Callable[[FleetRun], Awaitable[None]] | None = None) -> FleetRun:
        """Run every agent to its end; `chaos(self)` runs alongside (kill a proxy, stop Redis...)."""
        limits = httpx.Limits(max_connections=len(self.agents) + 16, max_keepalive_connections=len(self.agents) + 16)
        http = openai.DefaultAsyncHttpxClient(limits=limits, event_hooks={"response": [self._on_response]})
        started = time.monotonic()
        async with openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key, max_retries=self.max_retries, timeout=300.0,
            http_client=http,
        ) as client:  # fmt: skip
            self._client = client

            async def one(agent: FleetAgent) -> None:
                for step in range(self.turns):
                    await agent.step(step)

            work = [asyncio.ensure_future(one(agent)) for agent in self.agents]
            extra = [asyncio.ensure_future(chaos(self))] if chaos is not None else []
            try:
                await asyncio.gather(*work, *extra)
            finally:
                for task in (*work, *extra):
                    task.cancel()
        self.wall_s = time.monotonic() - started
        return self

    async def wait_completed(self, count: int, poll: float = 0.05) -> None:
        """For a chaos coroutine: until `count` requests have got their 200."""
        while self.completed < count:
            await asyncio.sleep(poll)
