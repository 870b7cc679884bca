"""What tests of many engines share: a replica engine of either kind, agents run turn by turn on threads, and where each
generation ran by the engines' own logs (each replica's `generated()`: the prompt and completion ids of every generation
it ran)."""

from __future__ import annotations

import threading
from typing import Any, Protocol

from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread
from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread

from .basics import tokenizer_path


def engine_of(kind: str, **config: Any) -> Any:
    """A replica engine of `kind` (vllm or sglang) over the Qwen3 tokenizer, with `config`'s fields, not started."""
    if kind == "vllm":
        return VllmReplicaThread(VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"), **config))
    return ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"), **config))


class TurnTaker(Protocol):
    def turn(self) -> None: ...


def run_turns(agents: list[Any], turns: int, failures: list[BaseException]) -> list[threading.Thread]:
    """Each agent's next `turns` turns on a thread of its own, started; an agent's failure is appended to `failures`."""

    def run(agent: TurnTaker) -> None:
        try:
            for _ in range(turns):
                agent.turn()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(agent,)) for agent in agents]
    for thread in threads:
        thread.start()
    return threads


def generations(engines: list[Any]) -> dict[tuple[int, ...], list[tuple[int, list[int]]]]:
    """prompt ids -> [(engine index, completion ids)] of every generation the engines ran."""
    found: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
    for index, engine in enumerate(engines):
        for entry in engine.generated():
            found.setdefault(tuple(entry["prompt_ids"]), []).append((index, list(entry["completion_ids"])))
    return found
