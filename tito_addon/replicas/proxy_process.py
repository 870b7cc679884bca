"""Runs the addon in a real `mitmdump` subprocess on a loopback port, as users run it.

Used by `python -m tito_addon demo` and by the integration tests.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import ClassVar

from tito_addon.replicas.mitmdump_forks import ForkedProcess, ForkServer, NotForked

REPO = Path(__file__).resolve().parents[2]
LISTEN = re.compile(r"listening at (?:\S+? )?\[?127\.0\.0\.1\]?:(\d+)")


class Mitmdump:
    """`mitmdump -s tito_addon/__init__.py` (or `python -m tito_addon`) in reverse mode, run from `cwd`; `program`
    runs another of mitmproxy's tools the same way (`mitmweb`)."""

    #: Every instance made in this process, so a test session can audit all their logs and recordings at the end.
    instances: ClassVar[list[Mitmdump]] = []
    #: Where a harness that starts many of them has them forked from one warmed interpreter (`mitmdump_forks`); each
    #: start it cannot serve (another environment, a launcher, `python -m`) is a plain subprocess.
    forks: ClassVar[ForkServer | None] = None

    def __init__(
        self,
        backend_url: str,
        *,
        tokenizer: str,
        record_dir: Path,
        cwd: Path,
        family: str = "qwen3",
        options: dict[str, str] | None = None,
        via_module: bool = False,
        extra_args: list[str] | None = None,
        mode: str | None = None,
        launcher: list[str] | None = None,
        repo: Path | None = None,
        program: str = "mitmdump",
    ) -> None:
        """`launcher` is an argv prefix the process is started under (`nsenter --net=…` runs it in another network
        namespace); the listening port is still read from its output. `repo`: another checkout of the project to
        run (a benchmark's "before")."""
        repo = repo or REPO
        settings = {
            "tito_tokenizer": tokenizer,
            "tito_model_family": family,
            "tito_record_dir": str(record_dir),
            **(options or {}),
        }
        common = ["--mode", mode or f"reverse:{backend_url}", "--listen-host", "127.0.0.1", "-p", "0"]
        for key, value in settings.items():
            common += ["--set", f"{key}={value}"]
        common += extra_args or []
        if via_module:
            self.argv = [sys.executable, "-m", "tito_addon", *common]
        else:
            tool = Path(sys.executable).with_name(program)
            script = repo / "tito_addon" / "__init__.py"
            self.argv = [str(tool), "-s", str(script), "--set", "connection_strategy=lazy", *common]
        self.argv = [*(launcher or []), *self.argv]
        # Its log is read line by line from a pipe, where Python would otherwise hold lines back in a block buffer:
        # the "listening at" line would come only at exit (a shell without PYTHONUNBUFFERED, as a newcomer's is).
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if via_module:
            env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
        self.env = env
        self.cwd = cwd
        self.record_dir = Path(record_dir)
        Mitmdump.instances.append(self)
        self.lines: list[str] = []
        self.port: int | None = None
        self.proc: subprocess.Popen[str] | ForkedProcess | None = None

    def start(self, timeout: float = 90.0) -> Mitmdump:
        self.proc = None
        if Mitmdump.forks is not None:
            with contextlib.suppress(NotForked):
                self.proc = Mitmdump.forks.spawn(self.argv, self.cwd, self.env)
        if self.proc is None:
            self.proc = subprocess.Popen(
                self.argv, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        found = threading.Event()

        def drain() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                match = LISTEN.search(line)
                if match and self.port is None:
                    self.port = int(match.group(1))
                    found.set()
            found.set()

        threading.Thread(target=drain, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not found.wait(0.1):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("mitmdump did not start:\n" + self.output())
        if self.port is None:
            self.stop()
            raise RuntimeError("mitmdump exited:\n" + self.output())
        return self

    def run_to_exit(self, timeout: float = 90.0) -> tuple[int, str]:
        """For a configuration that must be refused: wait for the process to exit on its own."""
        if Mitmdump.forks is not None:
            with contextlib.suppress(NotForked):
                return Mitmdump.forks.run_to_exit(self.argv, self.cwd, self.env, timeout)
        result = subprocess.run(
            self.argv,
            cwd=self.cwd,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
        return result.returncode, result.stdout

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return "".join(self.lines)

    def kill(self) -> int | None:
        """SIGKILL, as a crash would: no shutdown hook runs, nothing is flushed or closed by the process."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> Mitmdump:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
