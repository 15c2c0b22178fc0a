"""How a site's update leaves: a small one at once, a large (chunked) one in an upload turn of the PS.

The broker holds a chunked update until the PS has fetched it; turns (ps_daemon/turns.py, docs/protocol.md,
"Upload turns") keep the number held at once bounded whatever the number of sites. The update is stored durably
before anything leaves (site_agent/store.py), so every turn can be answered, also after a restart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from fedmqtt.faults import crash_point
from fedmqtt.transport import topics
from fedmqtt.transport.channel import Channel
from schemas import messages as m
from schemas.codec import Encoded, decode, encoded_size
from site_agent.store import UplinkStore

log = logging.getLogger("fedmqtt.site")


@dataclass(frozen=True)
class ReadyUpdate:
    """A stored update too large for one message, waiting for (or sent in) an upload turn of the PS."""

    session: str
    round: int
    model_hash: str
    nbytes: int


class Uplink:
    def __init__(self, channel: Channel, store: Callable[[], UplinkStore], *, run_id: str, site_id: str) -> None:
        """`store()`: the site's current uplink store (a new session replaces it)."""
        self.channel = channel
        self.store = store
        self.site_id = site_id
        self.topic = topics.site_update_topic(run_id, site_id)
        self.ready: ReadyUpdate | None = None  # announced as update_ready
        self._held: tuple[Encoded, m.ClientUpdate] | None = None  # its bytes and message, until the first turn
        self._answered_grant: int | None = None  # the upload turn we last used
        self.turn: m.UploadTurn | None = None  # the newest on ps/turn/<site>
        self.ps_status: m.DaemonStatus | None = None  # for who else uploads now
        self._retained: tuple[str, int] | None = None  # (session, round) of our update at the broker

    def waiting_note(self) -> str | None:
        """What this site waits for while its ready update has no turn yet (None: it does not wait for one)."""
        if self.ready is None or self._answered_grant is not None:
            return None
        turns = self.ps_status.upload_turns if self.ps_status is not None else {}
        return (f"round {self.ready.round}: update stored; waiting for an upload turn from the PS (now uploading: "
                f"{', '.join(turns) or 'nobody'})")

    def offer(self, task: m.TrainTask, payload: Encoded, update: m.ClientUpdate | None) -> bool:
        """Publish a small update now (False); take a large one as ready (True: the caller announces
        `update_ready`, then calls `take_turn`). `payload`: the stored encoding of `update`, as bytes or pieces."""
        size = encoded_size(payload)
        if size <= self.channel.transport.settings.chunk_threshold_bytes:
            self._publish(task.session, task.round, payload, update)
            return False
        self.ready = ReadyUpdate(task.session, task.round, task.model_hash, size)
        # Held until the turn, as a direct publish would hold it: the first turn needs no re-read and re-decode.
        self._held = (payload, update) if update is not None else None
        self._answered_grant = None
        log.info("round %d: update of %.1f MB stored; waiting for an upload turn from the PS", task.round,
                 size / 1e6)
        return True

    def on_ps_status(self, status: m.DaemonStatus) -> None:
        self.ps_status = status
        if status.state == "done" and self._retained is not None and self._retained[0] == status.session:
            self.channel.clear(self.topic)  # a run that ended without a later model (on_model) leaves nothing
            self._retained = None

    def on_turn(self, turn: m.UploadTurn) -> None:
        self.turn = turn
        self.take_turn()

    def take_turn(self) -> None:
        """Upload the ready update when the newest turn of the PS is for it and has not been used yet."""
        ready, turn = self.ready, self.turn
        if ready is None or turn is None or (turn.session, turn.round) != (ready.session, ready.round):
            return
        grant = turn.grant
        if grant == self._answered_grant:
            return
        held, self._held = self._held, None
        payload: Encoded | None
        payload, update = held if held is not None else (self.store().load("update", ready.round, ready.model_hash),
                                                         None)
        if payload is None:
            log.warning("round %d: upload turn, but the stored update is gone; the PS will ask again", ready.round)
            self.ready = None
            return
        self._answered_grant = grant
        log.info("round %d: upload turn %d: sending the update", ready.round, grant)
        self._publish(ready.session, ready.round, payload, update)

    def on_model(self, model: m.GlobalModel) -> None:
        """A model of a later round means the PS closed ours and checkpointed before publishing it: our update is
        aggregated (or came too late) and needs no retained copy at the broker, where it cost one model's worth
        of memory per site. A PS resumed from an older checkpoint asks again; the stored copy answers."""
        if self.ready is not None and (model.session != self.ready.session or model.round > self.ready.round):
            self.ready, self._held = None, None
        if self._retained is None:
            return
        session, round_no = self._retained
        if model.session == session and model.round > round_no:
            self.channel.clear(self.topic)
            self._retained = None
            log.info("round %d: the PS has moved on to round %d; removed our update from the broker", round_no,
                     model.round)

    def _publish(self, session: str, round_no: int, payload: Encoded, update: m.ClientUpdate | None) -> None:
        message: object = update
        if update is None:  # read back from the store: one file's bytes
            assert isinstance(payload, bytes)
            message = decode(payload, max_bytes=self.channel.max_bytes)
        crash_point("site_before_publish", round_no)
        self.channel.send(self.topic, message, payload=payload)
        self._retained = (session, round_no)
        crash_point("site_after_publish", round_no)


__all__ = ["ReadyUpdate", "Uplink"]
