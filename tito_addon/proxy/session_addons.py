"""Live sessions in the mitmproxy shell: the periodic sweep that closes idle and excess ones, and the console command
that lists them. Each reads the sessions from the wiring, as configured now."""

from __future__ import annotations

import asyncio
import logging
import time

from mitmproxy import command
from mitmproxy.utils import asyncio_utils

from tito_addon.proxy.turn_wiring import TurnWiring
from tito_addon.sessions.session_tree import sweep_interval
from tito_addon.tito_errors import TitoError

logger = logging.getLogger(__name__)


class SessionSweeper:
    """Closes idle sessions and those beyond capacity, every quarter of the idle timeout (at least every 5 s), and
    settles a shared store's failed commits."""

    def __init__(self, wiring: TurnWiring) -> None:
        self.wiring = wiring
        self._task: asyncio.Task[None] | None = None

    def running(self) -> None:
        if self._task is None:
            self._task = asyncio_utils.create_task(self._sweep_forever(), name="tito-session-sweep", keep_ref=True)

    async def _sweep_forever(self) -> None:
        while True:
            settings = self.wiring.settings
            await asyncio.sleep(sweep_interval(settings.session_idle_timeout if settings is not None else 0.0))
            service = self.wiring.service
            if service is None:
                continue
            try:
                await service.sweep()
            except TitoError as error:
                logger.warning("tito: session sweep failed: %s", error.message)
            except Exception:
                logger.exception("tito: session sweep failed")

    def done(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


class SessionListing:
    def __init__(self, wiring: TurnWiring) -> None:
        self.wiring = wiring

    @command.command("tito.sessions")
    def sessions(self) -> str:
        """Live sessions: id, turns, tokens, turns in flight and idle seconds."""
        settings = self.wiring.settings
        if settings is not None and settings.session_store != "memory":
            table = (
                "sessions live in the shared store, not in this process: `redis-cli -u URL ZRANGE tito:live 0 -1` "
                "lists them, `HGETALL tito:s:{ID}` shows one (turns, tokens, next turn id)"
            )
            logger.info("tito sessions: %s", table)
            return table
        now = time.time()
        live = self.wiring.memory.tree.sessions
        rows = [f"{'session':36} {'turns':>6} {'tokens':>9} {'busy':>4} {'idle s':>7}"]
        for session in live.values():
            rows.append(
                f"{session.session_id[:36]:36} {session.turns:>6} {session.tokens:>9} {session.inflight:>4} "
                f"{now - session.last_used:>7.0f}"
            )
        table = "\n".join(rows)
        logger.info("tito sessions (%d live):\n%s", len(live), table)
        return table
