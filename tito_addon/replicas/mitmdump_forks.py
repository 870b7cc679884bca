"""Starts `mitmdump` processes by forking one warmed interpreter, for a harness that starts hundreds of them.

A fresh `mitmdump -s tito_addon/__init__.py` spends about half of its ~2.5 s start importing mitmproxy, transformers
and the other libraries the addon loads; a test run starts ~140 of them. The fork server imports those libraries
once and forks a child per start. The child is a real mitmdump: it runs the venv's own `mitmdump` console script
(`runpy`, as `__main__`), with the requested argv, working directory, environment and stdout/stderr pipe, so mitmproxy
parses the options, loads the addon script from its file (the addon itself is never imported by the server), and
runs its own event loop and signal handlers; it exits as a process does, with its code reported as `Popen` reports
it (-N for signal N). Only what the libraries did at import is shared, done once before any child's environment was
set: so `ForkServer.spawn` forks only for the environment the server started with, and says no otherwise. What still
tells a child from a fresh process: its /proc cmdline is the server's, and it shares the server's hash seed.

The server is this file run by path (`python -P`: its folder is not put on sys.path). It speaks over a SOCK_SEQPACKET
pair, one JSON message a packet: a start request carries the child's stdout pipe as a passed descriptor; the server
answers with the child's pid, then with its exit code when it is reaped (one pidfd a child; one thread, no locks held
across a fork). When the harness's end closes, the server kills the children left and exits.
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

#: Imported once by the server, so every child finds them in sys.modules: what the addon loads at start, not the addon.
WARM_MODULES = (
    "mitmproxy.tools.main",
    "mitmproxy.tools.dump",
    "mitmproxy.addons",
    "transformers",
    "transformers.models.auto.tokenization_auto",
    "transformers.tokenization_utils_tokenizers",
    "transformers.models.qwen2.tokenization_qwen2",
    "transformers.models.qwen2.tokenization_qwen2_fast",
    "tokenizers",
    "jinja2",
    "pydantic",
    "aiohttp",
    "orjson",
    "h11",
    "redis.asyncio",
)
#: What may differ between the server's environment and a child's, being read only after the imports: pytest names
#: the running test in it; transformers reads its advisory switch at each warning (the replica's command sets it).
VARYING = frozenset({"PYTEST_CURRENT_TEST", "TRANSFORMERS_NO_ADVISORY_WARNINGS"})
_MESSAGE = 1 << 16


class NotForked(RuntimeError):
    """This start cannot be a fork (another program or environment, or the server has exited): the caller starts
    its process from scratch instead."""


class ForkedProcess:
    """The part of `subprocess.Popen` the harness uses, for a child of the fork server."""

    def __init__(self, argv: list[str], pid: int, stdout: IO[str]) -> None:
        self.args = argv
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _reaped(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # not reaped yet, so the pid is still this child's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The harness's end: starts the server on first use and forks mitmdumps from it, from any thread."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = dict(os.environ if env is None else env)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._server: subprocess.Popen[bytes] | None = None
        self._started: dict[int, threading.Event] = {}
        self._answers: dict[int, dict] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._next = 0
        self._broken = False

    def serves(self, argv: list[str], env: dict[str, str]) -> bool:
        """Whether a child started from this server would be the process `argv` and `env` describe."""
        mitmdump = Path(sys.executable).with_name("mitmdump")
        if self._broken or not argv or argv[0] != str(mitmdump):
            return False
        return _fixed(env) == _fixed(self.env)

    def spawn(self, argv: list[str], cwd: Path, env: dict[str, str]) -> ForkedProcess:
        """A forked child that is the process `argv` and `env` describe, or NotForked."""
        if not self.serves(argv, env):
            raise NotForked("the fork server starts only this venv's mitmdump, in its own environment")
        read_end, write_end = os.pipe()
        try:
            with self._lock:
                if self._broken:
                    os.close(read_end)
                    raise NotForked("the mitmdump fork server has exited")
                sock = self._connect()
                self._next += 1
                ask = self._next
                started = self._started[ask] = threading.Event()
                request = {"ask": ask, "argv": argv, "cwd": str(cwd), "env": env}
                socket.send_fds(sock, [json.dumps(request).encode()], [write_end])
        finally:
            os.close(write_end)
        if not started.wait(60):
            os.close(read_end)
            raise RuntimeError("the mitmdump fork server did not answer in 60 s")
        self._started.pop(ask)
        answer = self._answers.pop(ask)
        if "error" in answer:
            os.close(read_end)
            raise NotForked(f"the mitmdump fork server could not fork: {answer['error']}")
        child = ForkedProcess(argv, answer["pid"], os.fdopen(read_end, "r", encoding="utf-8", errors="replace"))
        with self._lock:
            self._children[child.pid] = child
            code = self._early_exits.pop(child.pid, None)
        if code is not None:
            child._reaped(code)
        return child

    def run_to_exit(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
        """`subprocess.run` for a forked child: its exit code and all it wrote, TimeoutExpired (it is killed), or
        NotForked."""
        child = self.spawn(argv, cwd, env)
        output: list[str] = []
        reader = threading.Thread(target=lambda: output.append(child.stdout.read()), daemon=True)
        reader.start()
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise
        reader.join(timeout)
        child.stdout.close()
        return code, "".join(output)

    def start(self) -> ForkServer:
        """Starts the server now, so it warms while the caller does other work; `spawn` would start it anyway."""
        with self._lock:
            self._connect()
        return self

    def close(self) -> None:
        with self._lock:
            sock, server = self._sock, self._server
            self._sock = self._server = None
        if sock is not None:
            # shutdown, not only close: the reader thread's blocked recv holds the socket open until it returns.
            sock.shutdown(socket.SHUT_RDWR)  # the server sees its end close, kills what is left and exits
            sock.close()
        if server is not None:
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()

    def _connect(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._server = subprocess.Popen(
                [sys.executable, "-P", __file__, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        self._sock = ours
        threading.Thread(target=self._read_answers, args=(ours,), name="mitmdump-forks", daemon=True).start()
        return ours

    def _read_answers(self, sock: socket.socket) -> None:
        while True:
            try:
                packet = sock.recv(_MESSAGE)
            except OSError:
                packet = b""
            if not packet:
                break
            answer = json.loads(packet)
            if "exit" in answer:
                with self._lock:
                    child = self._children.pop(answer["exit"], None)
                    if child is None:  # reaped before spawn() filed it
                        self._early_exits[answer["exit"]] = answer["code"]
                if child is not None:
                    child._reaped(answer["code"])
            else:
                self._answers[answer["ask"]] = answer
                self._started[answer["ask"]].set()
        # The server is gone: no further exits will be reported, so nothing may wait on one.
        with self._lock:
            self._broken = True
            orphans, self._children = list(self._children.values()), {}
            for ask, started in self._started.items():
                if not started.is_set():
                    self._answers[ask] = {"error": "the fork server exited"}
                    started.set()
        for child in orphans:
            child._reaped(-signal.SIGKILL)


def _fixed(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key not in VARYING}


def _become_mitmdump(request: dict, out: int, sock: socket.socket, pidfds: list[int]) -> None:
    """In the child: take the requested process's shape, then run the console script. Never returns."""
    _die_with_the_server()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # detached, not closed: the socket object would otherwise close its number again at exit, by then maybe a file
    # of mitmdump's
    for fd in [sock.detach(), *pidfds]:
        os.close(fd)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=unbuffered)
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path.insert(0, os.path.dirname(script))  # as `python <script>` puts it there
    import runpy

    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def _die_with_the_server() -> None:
    """A child outlives neither the server nor its harness: the harness reports it killed once the server is gone."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the server died before the line above
        os._exit(1)


def serve(fd: int) -> None:
    for name in WARM_MODULES:
        try:
            __import__(name)
        except ImportError:  # another version's layout: the child imports what it needs itself
            pass
    if threading.active_count() > 1:
        # A fork copies only the forking thread, with whatever locks the others held: not safe. The harness sees the
        # server gone and starts each process from scratch.
        sys.exit(f"mitmdump fork server: an import started threads {threading.enumerate()}; not forking")
    sock = socket.socket(fileno=fd)
    pidfds: dict[int, int] = {}  # pidfd -> pid
    while (answers := _next_answers(sock, pidfds)) is not None:
        try:
            for answer in answers:
                sock.send(json.dumps(answer).encode())
        except OSError:  # the harness is gone
            break
    _end(pidfds)


def _next_answers(sock: socket.socket, pidfds: dict[int, int]) -> list[dict[str, object]] | None:
    """Waits for a request or an exit and acts on it; None once the harness has closed its end."""
    answers: list[dict[str, object]] = []
    readable, _, _ = select.select([sock.fileno(), *pidfds], [], [])
    for ready in readable:
        if ready != sock.fileno():
            pid = pidfds.pop(ready)
            os.close(ready)
            _, status = os.waitpid(pid, 0)
            answers.append({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
            continue
        try:
            packet, fds, _, _ = socket.recv_fds(sock, _MESSAGE, 1)
        except OSError:
            packet, fds = b"", []
        if not packet:
            return None
        request = json.loads(packet)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as error:
            os.close(fds[0])
            answers.append({"ask": request["ask"], "error": str(error)})
            continue
        if pid == 0:
            _become_mitmdump(request, fds[0], sock, list(pidfds))
        os.close(fds[0])
        pidfds[os.pidfd_open(pid)] = pid
        answers.append({"ask": request["ask"], "pid": pid})
    return answers


def _end(pidfds: dict[int, int]) -> None:
    for pidfd, pid in pidfds.items():
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        os.close(pidfd)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
