"""`mitmdump -r FILE`: a recorded flow's metadata holds its turn's record line; this addon writes it again.

Every flow the capture addon rewrote carries its whole record line in `flow.metadata["tito"]["record"]`, so a `-w`
flow file is enough to regenerate the trajectories offline, with or without a tokenizer. A turn already on disk is
not written twice.
"""

from __future__ import annotations

import logging

from mitmproxy import http

from tito_addon.proxy.turn_wiring import TurnWiring
from tito_addon.records.record_models import TurnRecord
from tito_addon.records.records_port import FileRecords, Records

logger = logging.getLogger(__name__)


class FlowFileRecords:
    def __init__(self, wiring: TurnWiring) -> None:
        self.wiring = wiring
        self.records: Records | None = None  # on tito_record_dir, when no turn service records
        self._written: dict[str, set[int]] = {}  # turn ids on disk, per session read so far

    def response(self, flow: http.HTTPFlow) -> None:
        if flow.live:
            return
        record = (flow.metadata.get("tito") or {}).get("record")
        if not isinstance(record, dict):
            return
        service = self.wiring.service
        if service is not None:
            records = service.sessions.records
        else:  # no turn service (no tokenizer: `-r` alone): the record dir the capture addon was given
            if self.records is None or str(self.records.record_dir) != str(self.wiring.facts.record_dir):
                self.records = FileRecords(self.wiring.facts.record_dir)
            records = self.records
        try:
            turn = TurnRecord.model_validate(record)
        except ValueError:
            logger.warning("tito: flow %s carries an unreadable record; skipped", flow.id)
            return
        known = self._written.get(turn.session_id)
        if known is None:
            recorded = records.read(turn.session_id)
            known = {t.turn_id for t in recorded.turns} if recorded is not None else set()
            self._written[turn.session_id] = known
        if turn.turn_id not in known:
            records.append_turn_record(turn)
            known.add(turn.turn_id)
