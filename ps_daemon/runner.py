"""The PS's loop: MQTT in -> events -> `Machine.step` -> effects out (checkpoint before publish).

What each side means lives beside it: `inbound` (message -> event), `outbound` (effect -> checkpoint, message),
`status` (ps/status, refusal counts, reminders), `model_init` (the round-1 model), `final_outputs` (the report).
"""

from __future__ import annotations

import logging
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from fedmqtt.atomic import private_dir
from fedmqtt.data.feature_wire import read_statistics_message
from fedmqtt.errors import BrokerError, CheckpointError, ConfigError, DataError
from fedmqtt.participant_dp import load_accountants
from fedmqtt.strategies import build_strategy
from fedmqtt.strategies.base import manifest_from_dict
from fedmqtt.transport import topics
from fedmqtt.transport.channel import Channel
from fedmqtt.transport.mqtt import MqttTransport
from fedmqtt.transport.signing import Identity
from fedmqtt.transport.topics import ParsedTopic
from ps_daemon import effects as fx
from ps_daemon import feature_gate
from ps_daemon.audit_trail import RunAudit, refusal_totals
from ps_daemon.checkpoint import CheckpointStore, checkpoint_to_state
from ps_daemon.config import DaemonConfig
from ps_daemon.events import Event, Started, Tick
from ps_daemon.inbound import UNUSABLE_CONTENT, InboundEvents
from ps_daemon.init_model_file import load_init_model
from ps_daemon.machine import Machine
from ps_daemon.metrics_hooks import metrics_for
from ps_daemon.model_init import hash_weights, initial_model
from ps_daemon.outbound import Outbound
from ps_daemon.participant_spent import spent_in_run
from ps_daemon.spool import UpdateSpool
from ps_daemon.state import DaemonState
from ps_daemon.status import PS, Reminders, StatusBoard, few_sites, status_message
from ps_daemon.turns import UploadTurns
from schemas import messages as m
from schemas.chunks import ChunkManifest
from schemas.codec import encode

log = logging.getLogger("fedmqtt.ps")


class DaemonRunner:
    def __init__(self, config: DaemonConfig, *, resume: bool = False, force: bool = False,
                 transport_factory: Callable[..., Any] | None = None, identity: Identity | None = None,
                 on_round: Callable[[m.RoundMetrics], None] | None = None) -> None:
        """`transport_factory(client_id=..., will=...)` makes the connection (default: MQTT to the broker
        in the config's credentials; `fedmqtt simulate` passes an in-process one). `identity`: what the PS signs
        with and verifies against (default: the `[signing]` table of the config's credentials). `force`: start
        afresh even where out_dir holds checkpoints of an earlier start (they are removed). `on_round`: called
        with each closed round's metrics as they are published (`--track`, fedmqtt.tracking)."""
        self.config = config
        self._transport_factory = transport_factory or (
            lambda **kw: MqttTransport(config.broker_settings(), **kw))
        self.identity = identity if identity is not None else config.identity()
        self.machine = Machine(config, build_strategy(config.algorithm, config.strategy_params()), hash_weights,
                               verifier=self.identity.ring)
        private_dir(config.out_dir)  # checkpoints, spooled updates and reports are the PS's alone
        self.store = CheckpointStore(config.out_dir / "checkpoints", keep=config.keep_checkpoints)
        self.spool = UpdateSpool(config.out_dir / "spool")
        # Grant numbers start at this start's time in ms: a resumed PS never repeats one a site has answered.
        self.turns = UploadTurns(config.upload_turns, first_grant=time.time_ns() // 1_000_000,
                                 max_bytes=config.upload_turn_bytes)
        self._turns_out: dict[str, int] = {}  # what ps/turn/<site> holds now (site -> grant)
        self.resume = resume
        self.force = force
        self._on_round = on_round
        self.reminders = Reminders(config, self.turns)
        self.audit = RunAudit(config)  # <out_dir>/audit/ps.jsonl: starts, rounds, the end (docs/audit.md)
        self._stop = False
        self._started_at = time.time()
        self._seen_connects = 0
        self.usage: dict[int, dict[str, dict[str, Any]]] = {}  # round -> site -> ResourceUsage, for the report
        self.update_bytes: dict[int, dict[str, int]] = {}  # round -> site -> accepted update's size, for ps/metrics
        self.metrics = metrics_for(config)  # the Prometheus endpoint ([metrics] port), or hooks doing nothing

    @property
    def finished(self) -> DaemonState | None:
        """The final state, once the run's outputs are written."""
        return self.outbound.finished

    # -- setup ----------------------------------------------------------------------------------
    def _load_state(self) -> DaemonState:
        return self._with_kept_statistics(self._load_checkpoint_or_new())

    def _with_kept_statistics(self, state: DaemonState) -> DaemonState:
        """The federation's feature statistics an earlier start of this run combined and kept: with --resume they
        are used again (the sites are not asked again); a fresh start removes them and asks afresh."""
        path = feature_gate.statistics_path(self.config)
        if not path.is_file():
            return state
        if not self.resume or not feature_gate.wanted(self.config):
            path.unlink()
            log.info("removed the feature statistics of an earlier start (%s)", path)
            return state
        try:
            stats = read_statistics_message(path)
        except DataError as exc:
            raise CheckpointError(f"{exc}; remove it to ask the sites for their summaries again") from None
        if stats.run_id != self.config.run_id:
            raise CheckpointError(f"{path}: feature statistics of run {stats.run_id!r}, not {self.config.run_id!r}")
        log.info("--resume: the federation's feature statistics of sites %s from %s", ", ".join(stats.sites), path)
        return replace(state, feature_statistics=stats)

    def _load_checkpoint_or_new(self) -> DaemonState:
        latest, removed = self.store.latest(), 0
        if self.resume:
            if latest is None:
                log.info("--resume: no checkpoint in %s yet (round 1 had not closed); starting the run from its "
                         "config", self.store.folder)
            else:
                ckpt = self.store.load_latest(run_id=self.config.run_id, config_hash=self.config.config_hash())
                state = checkpoint_to_state(ckpt, self.store.folder)
                if not state.session:  # a checkpoint from before sessions existed
                    state = replace(state, session=secrets.token_hex(8))
                where = (f"round {ckpt.round} of {self.config.rounds}" if ckpt.phase == "training"
                         else "the final evaluation")
                log.info("resuming from checkpoint of round %d (%s): session %s continues with %s",
                         ckpt.round - 1, latest, state.session, where)
                self.audit.started("resume", state)
                return state
        elif latest is not None:
            if not self.force:
                raise CheckpointError(
                    f"{self.store.folder} holds checkpoints of an earlier start of this run (newest: "
                    f"{latest.name}). Continue it with `fedmqtt ps start --config ... --resume`, or "
                    "start over with `--force` (removes those checkpoints)")
            removed = self.store.clear()
            log.warning("--force: removed %d checkpoint(s) of an earlier start in %s", removed, self.store.folder)
        weights, manifest = initial_model(self.config, resume=self.resume)
        extras = {}
        if self.config.pretrained is not None:  # AdaFed's: checked like init_model, as exactly this model's state
            extras["pretrained"], _ = load_init_model(self.config.pretrained, weights, manifest, tensors="all",
                                                    what="pretrained")
        session = secrets.token_hex(8)
        log.info("run %s: new session %s", self.config.run_id, session)
        state = self.machine.initial_state(weights, manifest_from_dict(manifest), extras, session=session)
        self.audit.started("resume" if self.resume else "force" if removed else "fresh", state,
                           removed_checkpoints=removed)
        return state

    def start(self) -> None:
        """Load or create the state, connect, subscribe, and publish the first effects."""
        c = self.config
        self.metrics.start()  # first: a taken port stops the PS before it loads, or removes, any checkpoint
        self.state = self._load_state()
        every_site_problem(c, self.machine, self.state)
        if c.algorithm == "dp-fedavg":  # its epsilon after each round needs Opacus: loaded before the loop runs
            log.info("loading Opacus' accountants for participant-level DP")
            load_accountants()
        will = encode(status_message(c, "offline", session=self.state.session, rejected={},  # nothing refused yet
                                     detail="PS disconnected"))
        self.channel = Channel.open(self._transport_factory, client_id=f"fedmqtt-ps-{c.run_id}",
                                    will=(topics.ps_status_topic(c.run_id), will), run_id=c.run_id,
                                    identity=self.identity)
        self.status = StatusBoard(c, self.channel, self.turns)
        self.inbound = InboundEvents(c, self.machine, self.channel, self.spool, self.turns, self.status,
                                     usage=self.usage, update_bytes=self.update_bytes)
        self.outbound = Outbound(c, self.channel, self.store, self.spool, self.status, usage=self.usage,
                                 update_bytes=self.update_bytes, started_at=self._started_at,
                                 on_round=self._on_round)
        self.channel.admit_manifest = self._admit_manifest  # refuse a chunked upload before fetching a byte of it
        self.metrics.sample(self)  # numbers while the PS waits for the broker
        self.channel.connect(timeout_s=None)
        # Statuses first: retained site statuses are replayed before any retained update. These filters
        # do not match `<topic>/chunk/<i>`: chunks are fetched one transfer at a time (transport/bulk.py).
        kinds = ("status", "update", "report", *(("secagg",) if c.secure_aggregation.enabled else ()),
                 *(("features",) if feature_gate.wanted(c) else ()))
        for kind in kinds:
            self.channel.transport.subscribe([topics.any_site_filter(c.run_id, kind)])
        # A hospital behind its own bridged broker: the bridge's Will "0" says its broker or link is down.
        self.channel.transport.subscribe([topics.any_bridge_filter(c.run_id)])
        if self.resume:  # turns the previous PS process granted are void: it is gone, and so is its count of them
            self.channel.bulk.publish_many((topics.ps_turn_topic(c.run_id, site), b"") for site in c.sorted_sites)
        self._apply(Started(time.time()))

    # -- the loop -------------------------------------------------------------------------------
    def poll(self, timeout_s: float) -> bool:
        """Handle at most one inbound message and the clock; True once the run is finished."""
        self._announce_if_reconnected()
        arrived = self.channel.receive(timeout_s)
        if arrived is not None:
            site, topic = arrived.topic.site_id or "?", arrived.topic
            event = self.inbound.event_of(self.state, arrived)
            # An accepted update's tensors are spooled by now: drop the message (as large as the model) before
            # the event may close the round, so aggregation, checkpoint and the next model do not sit beside it.
            del arrived
            if event is not None:
                self._step(event, site, topic)
        for offline in self.inbound.believed_offline(time.time()):
            self._apply(offline)
        self._apply(Tick(time.time()))
        self._grant_turns()
        self.status.send_held()
        self.status.refresh_rejections()
        if self.finished is None:
            self.reminders.remind(self.state)
        self.metrics.sample(self)
        return self.finished is not None

    def _admit_manifest(self, parsed: ParsedTopic, manifest: ChunkManifest) -> str | None:
        return self.inbound.admit_manifest(self.state, parsed, manifest)

    def _apply(self, event: Event) -> None:
        self.state, effects = self.machine.step(self.state, event)
        every_site_problem(self.config, self.machine, self.state)
        self._run_effects(effects)

    def _step(self, event: Event, site: str, topic: object) -> None:
        """`_apply` for an event from a message: one the machine cannot use is refused, and the PS serves on."""
        try:
            self.state, effects = self.machine.step(self.state, event)
        except UNUSABLE_CONTENT as exc:
            self.inbound.refuse_unusable(site, topic, exc)
            return
        self._run_effects(effects)

    def _run_effects(self, effects: list[fx.Effect]) -> None:
        for effect in effects:  # recorded before the round's checkpoint (see audit_trail)
            if isinstance(effect, fx.PublishRoundMetrics):
                self.audit.round_closed(effect.record, refusal_totals(self.channel.stats.rejected,
                                                                      self.status.rejections.values()))
        finishing = any(isinstance(e, fx.Finish) for e in effects)
        self.state = self.outbound.run_effects(self.state, effects)
        if finishing and self.finished is not None:
            self.audit.finished(self.finished)

    def close(self) -> None:
        c = self.config
        if self.finished is None:  # say we are gone (a clean disconnect does not fire the Will)
            self.audit.stopped(self.state, signalled=self._stop)
            final = encode(self.status.message("offline", session=self.state.session, detail="PS stopped",
                                               participant_dp=spent_in_run(c, self.state.history)))
            self.channel.close(final=(topics.ps_status_topic(c.run_id), final))
        else:
            self.channel.close()
        self.metrics.close(self, finished=self.finished is not None, interrupted=lambda: self._stop)

    def run(self) -> DaemonState:
        """Serve until the run is done or SIGTERM/SIGINT arrives; return the last state."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._request_stop)
        self.start()
        try:
            while not self._stop and not self.poll(0.5):
                pass
        except BrokerError:
            if not self._stop:
                raise  # when stopping, an interrupted publish is expected; the checkpoint is safe
        finally:
            self.close()
        return self.state

    def _announce_if_reconnected(self) -> None:
        """After a network loss the broker published our Will ("offline") on ps/status; after a broker restart
        it may also have lost the open round's retained model and tasks (SIGKILL, no persistence file). Publish
        all of it again: the same message ids, so a site that has them drops the copies."""
        connects = self.channel.transport.connects
        if connects != self._seen_connects:
            again = bool(self._seen_connects)
            self._seen_connects = connects
            if again:
                log.warning("reconnected to the broker: re-publishing the status and the open round")
                self._run_effects(self.machine.resend(self.state, "reconnected: re-published the open round"))

    def _grant_turns(self) -> None:
        """Hand free upload turns to ready sites: each new one at once on that site's ps/turn/<site> (one small
        message to one site: a turn on ps/status would reach every site, N^2 messages a round); ps/status lists
        them for observers at its own pace. A turn that ended (update in, site offline, taken back) is removed
        from the broker, so a site that restarts never mistakes it for a turn it still has."""
        s, c = self.state, self.config
        wanted = [x for x in s.selected if x not in s.updates] if s.phase == "training" else []
        fetcher = self.channel.fetcher
        self.turns.update(time.time(), round_no=s.round, wanted=wanted,
                          uploading=lambda site: fetcher.holds(topics.site_update_topic(c.run_id, site)))
        now = self.turns.view()
        if now == self._turns_out:
            return
        for site in self._turns_out.keys() - now.keys():
            self.channel.clear(topics.ps_turn_topic(c.run_id, site))
        for site, grant in now.items():
            if self._turns_out.get(site) != grant:
                self.channel.send(topics.ps_turn_topic(c.run_id, site), m.UploadTurn(
                    run_id=c.run_id, sender=PS, round=s.round, session=s.session, site_id=site, grant=grant))
        self._turns_out = now
        self.status.republish()
        if self.turns.granted:  # debug: one line per turn; the reminder says it at info every REMIND_S
            log.debug("round %d: upload turns %s; waiting for a turn: %s", s.round, ", ".join(self.turns.view()),
                      few_sites(self.turns.waiting()))

    def _request_stop(self, signum: int, frame: object) -> None:
        log.info("signal %d: stopping after the current step", signum)
        self._stop = True
        if hasattr(self, "channel"):  # a signal may come while the state loads, before the channel is open
            self.channel.interrupt()


def every_site_problem(config: DaemonConfig, machine: Machine, state: DaemonState) -> None:
    """evaluation = "all" needs a model every site holds whole: a site not selected to train validates the PS's
    global model, which for a rule keeping tensors on the sites (local layers, personalised ones) is not the model
    that site would use. Raised at start (local layers) or once the rule hands out personal tensors."""
    if config.evaluation != "all":
        return
    local = sorted(set(state.weights) - set(machine.shared_names(state)))
    if local or state.personal:
        raise ConfigError(
            "evaluation = \"all\" needs a model every site holds whole (the PS's global model); "
            f"{config.algorithm} keeps tensors on the sites ({', '.join(local[:3]) or 'personal ones'}), so a site "
            "that did not train would validate another model than its own. Set evaluation = \"selected\"")
