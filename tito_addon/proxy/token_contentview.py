"""The "TITO turn" content view: in mitmweb and the mitmproxy console, an agent flow that became a turn shows the
turn as tokens beside its raw JSON, and a flow the addon refused shows why.

The view reads only `flow.metadata["tito"]`: the whole record line of a committed turn (`record`), or the status and
error body of a refusal (`refused`, set by the capture addon). Both the request and the response of such a flow
render with it by default (a streamed turn's response body may be missing; its request is always there); every other
flow is left to mitmproxy's own views. Texts come from the token engine's tokenizer when the record names the same
tokenizer, else from the record's tokenizer directory when it is a local one (never a download, never remote code),
else the ids are shown alone. The segment is read from the record dir when the session is there.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from mitmproxy import contentviews, flow
from mitmproxy.contentviews import Contentview, Metadata
from pydantic import ValidationError

from tito_addon.engine.tokenizer_loading import RecordTokenizers
from tito_addon.proxy.turn_wiring import TurnWiring
from tito_addon.records.episode_segments import episode_segments
from tito_addon.records.record_models import TurnRecord
from tito_addon.records.records_port import FileRecords, Records
from tito_addon.records.turn_tokens import SegmentPlace, segment_place, turn_text, turn_tokens

logger = logging.getLogger(__name__)

VIEW_NAME = "TITO turn"
# Above mitmproxy's JSON view (1): the auto view of a tito flow; raw JSON stays one click away.
PRIORITY = 2.0


def tito_metadata(of: flow.Flow | None) -> dict[str, Any] | None:
    """The flow's `tito` metadata when it holds a turn's record or a refusal: what this view shows."""
    tito = of.metadata.get("tito") if of is not None else None
    if isinstance(tito, dict) and ("record" in tito or "refused" in tito):
        return tito
    return None


class RecordSegments:
    """Which segment of its session's part of the episode a turn is in, read from the record dir the addon writes
    (or `tito_record_dir`, when no turn service runs: `mitmweb -r flows`). None where that dir has not this turn."""

    def __init__(self, wiring: TurnWiring) -> None:
        self.wiring = wiring
        self._files: FileRecords | None = None
        # A committed turn's segment never changes (later segments number after it): found once per turn.
        self._found: dict[tuple[str, int, float], SegmentPlace] = {}

    def place(self, turn: TurnRecord) -> SegmentPlace | None:
        key = (turn.session_id, turn.turn_id, turn.ts)
        if key in self._found:
            return self._found[key]
        session_file = self._records().read(turn.session_id)
        if session_file is None:
            return None
        if next((t for t in session_file.turns if t.turn_id == turn.turn_id), None) != turn:
            return None  # another run's session of the same name: its segments are not this turn's
        found = segment_place(episode_segments([session_file]), turn)
        if found is not None:
            self._found[key] = found
        return found

    def _records(self) -> Records:
        service = self.wiring.service
        if service is not None:
            return service.sessions.records
        record_dir = self.wiring.facts.record_dir
        if self._files is None or str(self._files.record_dir) != str(Path(record_dir)):
            self._files = FileRecords(record_dir)
        return self._files


class TurnContentview(Contentview):
    """A tito flow's turn as tokens, or why it was refused."""

    def __init__(self, wiring: TurnWiring) -> None:
        self.wiring: TurnWiring | None = wiring
        self.tokenizers: RecordTokenizers | None = RecordTokenizers(lambda: wiring.engine)
        self.segments: RecordSegments | None = RecordSegments(wiring)

    @property
    def name(self) -> str:
        return VIEW_NAME

    def detach(self) -> None:
        """The addon was unloaded: let go of its wiring (its tokenizers, its records) and claim no flow again."""
        self.wiring = self.tokenizers = self.segments = None

    def render_priority(self, data: bytes, metadata: Metadata) -> float:
        if self.wiring is None or tito_metadata(metadata.flow) is None:
            return -1
        return PRIORITY

    def prettify(self, data: bytes, metadata: Metadata) -> str:
        tito = tito_metadata(metadata.flow)
        if self.wiring is None:
            return "The tito addon that registered this view is no longer loaded.\n"
        if tito is None:
            return not_a_turn(metadata.flow)
        try:
            if "record" in tito:
                return self._turn(tito["record"])
            return refusal_text(tito["refused"])
        except Exception as exc:  # noqa: BLE001 - a view of odd metadata says what is wrong, never fails the UI
            logger.exception("tito: the turn view failed on flow %s", getattr(metadata.flow, "id", "?"))
            return f"tito: this flow's turn could not be shown ({type(exc).__name__}: {exc}).\n"

    def _turn(self, line: Any) -> str:
        if not isinstance(line, dict):
            return f"tito: this flow's metadata holds a record that is not an object but {type(line).__name__}.\n"
        try:
            turn = TurnRecord.model_validate(line)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first.get("loc", ())) or "the record"
            return f"tito: this flow's record line is not a valid turn record ({where}: {first['msg']}).\n"
        if len(turn.completion_logprobs) != len(turn.completion_ids):
            return (
                f"tito: this flow's record has {len(turn.completion_logprobs)} log-probs for "
                f"{len(turn.completion_ids)} completion tokens; it cannot be shown as tokens.\n"
            )
        assert self.tokenizers is not None and self.segments is not None
        tokenizer, no_texts = self.tokenizers.for_record(turn.tokenizer.name, turn.tokenizer.tokenizer_sha256)
        try:
            segment = self.segments.place(turn)
        except Exception as exc:  # noqa: BLE001 - an unreadable record dir leaves the segment out, not the turn
            logger.warning("tito: cannot read the segment of %s turn %d: %s", turn.session_id, turn.turn_id, exc)
            segment = None
        text = turn_text(turn_tokens(turn, tokenizer, segment=segment))
        return text if no_texts is None else f"{text}\n(ids only: {no_texts})\n"


def refusal_text(refused: Any) -> str:
    """Why the addon answered an agent's request with an error: its status, the error's type and message."""
    if not isinstance(refused, dict):
        return f"tito: this flow's refusal metadata is not an object but {type(refused).__name__}.\n"
    error = refused.get("error")
    kind, message = error_fields(error)
    lines = [
        f"tito refused this request: HTTP {refused.get('status', '?')}",
        f"  error type    {kind or '-'}",
        f"  message       {message or '-'}",
        "",
        "It did not become a turn: nothing was recorded and no session changed. A refusal before the backend (a bad",
        "request, a closed session, an unconfigured proxy) forwarded nothing; a backend's failure was not recorded.",
    ]
    if kind is None and message is None and error is not None:
        lines += ["", "The error body:", json.dumps(error, ensure_ascii=False, indent=2)[:4000]]
    return "\n".join(lines) + "\n"


def error_fields(error: Any) -> tuple[str | None, str | None]:
    """The error type and message of any agent API's error body (OpenAI's and ours `{"error": {type, message}}`,
    Anthropic's `{"type": "error", "error": {...}}`, Gemini's `{"error": {status, message}}`), or of a plain text."""
    if isinstance(error, str):
        return None, error
    if not isinstance(error, dict):
        return None, None
    inner = error.get("error")
    if isinstance(inner, str):
        return None, inner
    if not isinstance(inner, dict):
        return None, None
    kind = inner.get("type") or inner.get("status")
    message = inner.get("message")
    return (str(kind) if kind is not None else None), (str(message) if message is not None else None)


def not_a_turn(of: flow.Flow | None) -> str:
    tito = of.metadata.get("tito") if of is not None else None
    if isinstance(tito, dict) and tito.get("replayed"):
        return (
            f"tito replayed this answer from recorded turn {tito.get('turn_id')} of session {tito.get('session_id')}; "
            "the turn's tokens are in the record it was replayed from.\n"
        )
    return "Not a tito turn: the tito addon did not answer this flow as a turn or refuse it.\n"


class TurnViewRegistration:
    """The addon that registers the view with mitmproxy while the script is loaded. Views are registered by name, so
    a hot reload replaces the old one; unloading takes it out again (and lets go of the wiring it held)."""

    def __init__(self, wiring: TurnWiring) -> None:
        self.view = TurnContentview(wiring)

    def load(self, loader: Any) -> None:
        contentviews.add(self.view)

    def done(self) -> None:
        self.view.detach()
        registry = contentviews.registry
        # mitmproxy 12 has no public way to unregister (`contentviews.remove` is a no-op kept for legacy views).
        registered = getattr(registry, "_by_name", None)
        key = self.view.name.lower()
        if isinstance(registered, dict) and registered.get(key) is self.view:
            del registered[key]
            registry.on_change.send(self.view)  # the console redraws its open flow without it
