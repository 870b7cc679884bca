"""The servers a benchmark measures against on this machine: the zero-latency backend (in a thread of this process,
or in a process of its own with a latency) and plain mitmdump in reverse mode, the passthrough baseline."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path

from zero_latency_backend import LAST_IDS_BODY, Reply
from zero_latency_backend import start as start_backend

from tito_addon.replicas.proxy_process import LISTEN

REPO = Path(__file__).resolve().parents[1]


class Backend:
    """`bench/zero_latency_backend.py` on its own event loop, in a thread of this process (`parse`: see there)."""

    def __init__(self, parse: str = "orjson", reply: Reply | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.runner, self.port = self.loop.run_until_complete(start_backend(parse=parse, reply=reply))
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        ready.wait(30)
        self.url = f"http://127.0.0.1:{self.port}"

    def last_ids_body(self) -> bytes:
        """The bytes of the last request that carried prompt ids (the addon's, when it was the last to send)."""
        return self.runner.app[LAST_IDS_BODY][0]


class BackendProcess:
    """`bench/zero_latency_backend.py` with a latency, in a subprocess."""

    def __init__(self, latency_s: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "zero_latency_backend.py"), "--latency", str(latency_s)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        self.url = line.strip().removeprefix("listening ")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


class PlainMitmdump:
    """mitmdump in reverse mode with no addon: the passthrough baseline (`extra_args`/`env`: e.g. a stub script)."""

    def __init__(self, target: str, extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        mitmdump = Path(sys.executable).with_name("mitmdump")
        argv = [str(mitmdump), "--mode", f"reverse:{target}", "--listen-host", "127.0.0.1", "-p", "0", *extra_args]
        self.proc = subprocess.Popen(argv + ["--set", "flow_detail=0"], stdout=subprocess.PIPE, text=True,
                                     env=None if env is None else {**os.environ, **env})  # fmt: skip
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            match = LISTEN.search(line)
            if match:
                threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
                self.url = f"http://127.0.0.1:{match.group(1)}"
                return
        raise RuntimeError("plain mitmdump did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)
