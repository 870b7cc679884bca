"""A fleet of real processes on loopback, for load tests of several proxies sharing one session space (issue 13).

`RedisServer` is a real redis-server that keeps its data across a stop and a start (append-only file, fsynced on
every write); `HAProxy` is a real haproxy balancing round-robin, without stickiness, over a list of backends (the
engine routers, `LoggedServer`s too, are `engine_routers`); `ProxyFleet` is N `mitmdump`s with the
addon, each on a fixed port (so one can be killed and restarted on the same port while HAProxy's health checks take
it out and put it back), all recording into the same directory, behind one HAProxy. Process helpers only: no test
logic here.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

from tito_addon.replicas.proxy_process import Mitmdump

__all__ = ["HAProxy", "FixedPortMitmdump", "LoggedServer", "ProxyFleet", "RedisServer", "free_port", "wait_for_port"]


_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _worker_slot() -> tuple[int, int]:
    """(this worker's index, the number of workers) when pytest-xdist runs tests side by side, else (0, 1): each
    worker hands out its own residue class of ports, so two workers never pick the same one between check and bind."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 0:
        return int(worker[2:]) % int(count), int(count)
    return 0, 1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing uses right now, outside the kernel's ephemeral range: a process restarted
    on it later must not find it taken by some client connection's local port."""
    low, high = _ephemeral_range()
    slot, slots = _worker_slot()
    candidates = [p for p in range(15000, 32000) if not low <= p <= high and p not in _HANDED_OUT and p % slots == slot]
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free port outside the ephemeral range")


def wait_for_port(port: int, timeout: float = 30.0, alive: subprocess.Popen | None = None) -> None:
    """Until 127.0.0.1:port accepts a connection; raises if `alive` exits first or the time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if alive is not None and alive.poll() is not None:
                raise RuntimeError(f"process exited with {alive.returncode} before listening on {port}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s") from None
            time.sleep(0.05)


def _stop(proc: subprocess.Popen | None, timeout: float = 20.0) -> int | None:
    if proc is None:
        return None
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class RedisServer:
    """`redis-server` on 127.0.0.1 with `appendonly yes` and `appendfsync always`: every acknowledged write is on
    disk, so `stop()` (SIGTERM) then `start()` on the same port and directory comes back with the same data."""

    def __init__(
        self, dir: Path, port: int | None = None, executable: str | None = None, appendfsync: str = "always"
    ) -> None:
        """`appendfsync="everysec"`: as production runs it (a benchmark), losing at most a second on a crash."""
        self.appendfsync = appendfsync
        self.dir = Path(dir)
        self.port = port or free_port()
        self.executable = executable or shutil.which("redis-server") or "/usr/bin/redis-server"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.dir / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 30.0) -> RedisServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        argv = [
            self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
            "--appendonly", "yes", "--appendfsync", self.appendfsync, "--save", "", "--daemonize", "no",
            "--protected-mode", "no", "--logfile", str(self.log_path),
        ]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not self.ping():  # accepting is not enough: it answers -LOADING while it replays its file
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"redis-server did not answer PING on {self.port}")
            time.sleep(0.05)
        return self

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def used_memory(self) -> int:
        """Redis's `used_memory` (INFO memory), in bytes."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
            sock.sendall(b"INFO memory\r\n")
            data = b""
            while b"used_memory:" not in data or not data.endswith(b"\r\n"):
                data += sock.recv(65536)
        line = next(x for x in data.split(b"\r\n") if x.startswith(b"used_memory:"))
        return int(line.split(b":")[1])

    def stop(self) -> int | None:
        """SIGTERM and wait: Redis closes its clients and exits; its append-only file already holds every write."""
        code = _stop(self.proc)
        self.proc = None
        return code

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LoggedServer:
    """A server process listening on a port of 127.0.0.1, its output in a log file of its own work dir."""

    def __init__(self, port: int | None, name: str) -> None:
        self.port = port or free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"tito-{name}-"))
        self.log_path = self.workdir / f"{name}.out"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        raise NotImplementedError

    def prepare(self) -> None:
        """What must be in place before the process starts (a config file)."""

    def start(self, timeout: float = 30.0) -> Self:
        self.prepare()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for_port(self.port, timeout, alive=self.proc)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise RuntimeError(f"{exc}\n{self.output()}") from exc
        return self

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> int | None:
        code = _stop(self.proc)
        self.proc = None
        return code

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


class HAProxy(LoggedServer):
    """`haproxy -f cfg -db` in front of `backends` (http URLs): HTTP mode, round-robin per request, no stickiness,
    health checks every 300 ms that take a server out after one failure and back after one success, and a request
    whose connection fails is retried (twice) on another server."""

    def __init__(self, backends: list[str], port: int | None = None, executable: str | None = None) -> None:
        super().__init__(port, "haproxy")
        self.backends = list(backends)
        self.executable = executable or shutil.which("haproxy") or "/usr/sbin/haproxy"
        self.config_path = self.workdir / "haproxy.cfg"

    def config(self) -> str:
        servers = []
        for index, url in enumerate(self.backends):
            hostport = url.split("://", 1)[-1].rstrip("/")
            servers.append(f"    server p{index} {hostport} check inter 300ms fall 1 rise 1")
        return "\n".join(
            [
                "global",
                "    maxconn 8192",
                "",
                "defaults",
                "    mode http",
                "    option redispatch",
                "    retries 2",
                "    timeout connect 2s",
                "    timeout client 300s",
                "    timeout server 300s",
                "    timeout queue 60s",
                "    timeout http-request 60s",
                "    timeout http-keep-alive 60s",
                "    timeout check 2s",
                "",
                "frontend tito",
                f"    bind 127.0.0.1:{self.port}",
                "    default_backend proxies",
                "",
                "backend proxies",
                "    balance roundrobin",
                *servers,
                "",
            ]
        )

    def prepare(self) -> None:
        self.config_path.write_text(self.config())
        check = subprocess.run([self.executable, "-c", "-f", str(self.config_path)], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy refuses its config:\n{check.stdout}{check.stderr}\n{self.config()}")

    def argv(self) -> list[str]:
        return [self.executable, "-f", str(self.config_path), "-db"]


class FixedPortMitmdump(Mitmdump):
    """A `Mitmdump` that listens on a given port instead of `-p 0`, so a restart comes back where HAProxy looks."""

    def __init__(self, *args, listen_port: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for index in range(len(self.argv) - 1):
            if self.argv[index] == "-p" and self.argv[index + 1] == "0":
                self.argv[index + 1] = str(listen_port)
                break
        else:
            raise RuntimeError(f"no `-p 0` in mitmdump's argv to replace: {self.argv}")
        self.listen_port = listen_port


class ProxyFleet:
    """N mitmdumps with the addon against one backend, the same options, each in its own working directory and
    all recording into `record_dir`, behind one HAProxy (`url`). `kill(i)` SIGKILLs proxy i; `restart(i)` starts a
    fresh process on the same port, which HAProxy's health check puts back in rotation."""

    def __init__(
        self,
        backend_url: str,
        count: int,
        *,
        tokenizer: str,
        record_dir: Path,
        workdir: Path,
        options: dict[str, str] | None = None,
        family: str = "qwen3",
        extra_args: list[str] | None = None,
    ) -> None:
        self.backend_url = backend_url
        self.count = count
        self.tokenizer = tokenizer
        self.record_dir = Path(record_dir)
        self.workdir = Path(workdir)
        self.options = dict(options or {})
        self.family = family
        self.extra_args = list(extra_args or [])
        self.ports = [free_port() for _ in range(count)]
        self.proxies: list[FixedPortMitmdump | None] = [None] * count
        self.retired: list[FixedPortMitmdump] = []  # killed or replaced processes, whose logs stay readable
        self.haproxy = HAProxy([f"http://127.0.0.1:{port}" for port in self.ports])

    def _make(self, index: int) -> FixedPortMitmdump:
        cwd = self.workdir / f"proxy-{index}"
        cwd.mkdir(parents=True, exist_ok=True)
        proxy = FixedPortMitmdump(
            self.backend_url,
            tokenizer=self.tokenizer,
            record_dir=self.record_dir,
            cwd=cwd,
            family=self.family,
            options=self.options,
            extra_args=self.extra_args,
            listen_port=self.ports[index],
        )
        proxy.record_dir = self.record_dir
        return proxy

    def start_proxy(self, index: int, timeout: float = 90.0) -> FixedPortMitmdump:
        proxy = self._make(index)
        proxy.start(timeout)
        if proxy.port != self.ports[index]:
            proxy.stop()
            raise RuntimeError(f"proxy {index} listens on {proxy.port}, not {self.ports[index]}")
        self.proxies[index] = proxy
        return proxy

    def start(self) -> ProxyFleet:
        if any(p is not None for p in self.proxies):
            raise RuntimeError("the fleet is already started")
        try:
            for index in range(self.count):
                self.start_proxy(index)
            self.haproxy.start()
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout: float = 10.0) -> None:
        """Until every running proxy accepts connections, plus two health-check periods so HAProxy sees them up."""
        for proxy in self.proxies:
            if proxy is not None:
                wait_for_port(proxy.listen_port, timeout)
        time.sleep(0.7)

    @property
    def url(self) -> str:
        return self.haproxy.url

    def kill(self, index: int) -> int | None:
        """SIGKILL proxy `index`: no shutdown hook runs, nothing is flushed or closed by the process."""
        proxy = self.proxies[index]
        if proxy is None:
            return None
        self.proxies[index] = None
        self.retired.append(proxy)
        return proxy.kill()

    def restart(self, index: int, timeout: float = 90.0) -> FixedPortMitmdump:
        """Start proxy `index` again (after a kill, or replacing a running one) on its port."""
        if self.proxies[index] is not None:
            old = self.proxies[index]
            self.proxies[index] = None
            self.retired.append(old)
            old.stop()
        proxy = self.start_proxy(index, timeout)
        time.sleep(0.7)  # two health-check periods: HAProxy has put it back
        return proxy

    def all_processes(self) -> list[Mitmdump]:
        return [*self.retired, *(p for p in self.proxies if p is not None)]

    def output(self) -> str:
        return "\n".join(f"--- {p.cwd} ---\n{p.output()}" for p in self.all_processes())

    def stop(self) -> None:
        self.haproxy.stop()
        for index, proxy in enumerate(self.proxies):
            if proxy is not None:
                proxy.stop()
                self.retired.append(proxy)
                self.proxies[index] = None
        shutil.rmtree(self.haproxy.workdir, ignore_errors=True)

    def __enter__(self) -> ProxyFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
