"""The PS's only I/O: MQTT in -> events -> `Machine.step` -> effects out (checkpoint before publish)."""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from fedmqtt.errors import BrokerError, CheckpointError
from fedmqtt.faults import crash_point
from fedmqtt.recruitment import histogram_vector
from fedmqtt.strategies import SiteUpdate, build_strategy
from fedmqtt.strategies.base import Weights, manifest_from_dict
from fedmqtt.transport import topics
from fedmqtt.transport.channel import BridgeState, Channel, Inbound
from fedmqtt.transport.mqtt import MqttTransport
from ps_daemon import effects as fx
from ps_daemon.admission import histogram_rejection, manifest_rejection, report_rejection, update_rejection
from ps_daemon.checkpoint import (
    CheckpointStore,
    Layout,
    best_weights,
    checkpoint_to_state,
    drop_read_pages,
    open_maps,
    safetensors_layout,
    state_to_checkpoint,
)
from ps_daemon.config import DaemonConfig
from ps_daemon.events import Event, ReportReceived, SiteOffline, SiteOnline, Started, Tick, UpdateReceived
from ps_daemon.machine import Machine
from ps_daemon.report import build_report, per_site_csv, render_markdown
from ps_daemon.spool import UpdateSpool
from ps_daemon.state import DaemonState
from ps_daemon.turns import UploadTurns
from schemas import messages as m
from schemas.codec import encode
from schemas.tensors import arrays_to_blobs, blobs_to_arrays, tensors_hash

log = logging.getLogger("fedmqtt.ps")
PS = "ps"
REMIND_S = 30.0  # a waiting PS says what it waits for at least this often
STATUS_REFRESH_S = 5.0  # new rejection counts reach ps/status at most this often (a flood must not echo)
# Progress within one phase and round ("k/N updates") reaches ps/status at most this often: every site and
# observer receives each status, so one per update would cost N^2 messages a round (500 sites: 250,000).
# A change of phase or round goes out at once; the newest progress follows within this time.
STATUS_PROGRESS_S = 1.0
MAX_REASONS_SHOWN = 8  # per site in ps/status


def hash_weights(weights: dict) -> str:
    return tensors_hash(arrays_to_blobs(weights))


def initial_model(config: DaemonConfig) -> tuple[dict, dict]:
    """Round-1 weights and the tensor manifest from the model registry (docs/algorithms.md 0.2).

    Both need torch (the model's own initialisation, its module types). The PS daemon never imports
    torch itself: it asks a short-lived child process (`fedmqtt.training.init_model`), so its own
    memory stays small. In a simulation torch is loaded already and is used directly.
    """
    args = dict(config.model.args)
    if "torch" in sys.modules:
        from fedmqtt.training.models import model_manifest
        from fedmqtt.training.weights import initial_arrays

        return initial_arrays(config.model.name, args, config.seed), model_manifest(config.model.name, args)
    from safetensors.numpy import load_file

    out = config.out_dir / "initial"
    out.mkdir(parents=True, exist_ok=True)
    spec = json.dumps({"name": config.model.name, "args": args, "seed": config.seed})
    done = subprocess.run([sys.executable, "-m", "fedmqtt.training.init_model", spec, str(out)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"could not initialise model {config.model.name!r} (needs torch: fedmqtt[site]):\n"
                         f"{done.stderr[-2000:]}")
    path = out / "weights.safetensors"
    layout = safetensors_layout(path)  # read-only maps: the weights take no memory until a publish reads them
    weights = open_maps(path, layout) if layout is not None else load_file(str(path))
    return weights, json.loads((out / "manifest.json").read_text())


def _as_tuple(values: list[float] | None) -> tuple[float, ...] | None:
    return None if values is None else tuple(values)


def stable_msg_id(*parts: object) -> str:
    """Same message, same id: a resumed PS re-sends the round with the ids receivers already know. The session
    is one of the parts, so a fresh start with the same run id and seed never looks like a replay."""
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:32]


_CATEGORIES = (("stale or future round", "wrong round"), ("not selected", "not selected"),
               ("duplicate", "duplicate"), ("different model version", "wrong model version"),
               ("was not asked", "not asked"), ("answers session", "wrong session"),
               ("tensor", "wrong layout"), ("control variates", "wrong layout"), ("layer statistics", "wrong layout"),
               ("histogram", "bad histogram"), ("a_norm", "out of range"), ("training sample", "out of range"))


def _few(sites: list[str], shown: int = 8) -> str:
    """A bounded list of site names for a log line (hundreds of sites may wait)."""
    more = f" and {len(sites) - shown} more" if len(sites) > shown else ""
    return (", ".join(sites[:shown]) or "nobody") + more


def _category(reason: str) -> str:
    """A short, stable counter key for a refusal reason (the log line keeps the whole reason)."""
    return next((label for text, label in _CATEGORIES if text in reason), "refused")


class DaemonRunner:
    def __init__(self, config: DaemonConfig, *, resume: bool = False, force: bool = False,
                 transport_factory: Callable[..., Any] | None = None) -> None:
        """`transport_factory(client_id=..., will=...)` makes the connection (default: MQTT to the broker
        in the config's credentials; `fedmqtt simulate` passes an in-process one). `force`: start afresh even
        where out_dir holds checkpoints of an earlier start (they are removed)."""
        self.config = config
        self._transport_factory = transport_factory or (
            lambda **kw: MqttTransport(config.broker_settings(), **kw))
        self.machine = Machine(config, build_strategy(config.algorithm, config.strategy_params()), hash_weights)
        self.store = CheckpointStore(config.out_dir / "checkpoints", keep=config.keep_checkpoints)
        self._model_file: tuple[Weights, Path, Layout] | None = None  # the newest checkpoint's; see _map_weights
        self.spool = UpdateSpool(config.out_dir / "spool")
        # Grant numbers start at this start's time in ms: a resumed PS never repeats one a site has answered.
        self.turns = UploadTurns(config.upload_turns, first_grant=time.time_ns() // 1_000_000)
        self._turns_out: dict[str, int] = {}  # what ps/turn/<site> holds now (site -> grant)
        self.resume = resume
        self.force = force
        self.rejections: dict[str, Counter[str]] = {}  # site -> reason -> count, refused by the PS itself
        self._shown_rejections: dict[str, dict[str, int]] = {}
        self._status_refreshed_at = 0.0
        self._reminded_at = time.monotonic()
        self.finished: DaemonState | None = None
        self._stop = False
        self._started_at = time.time()
        self._seen_connects = 0
        self._last_status: m.DaemonStatus | None = None
        self._status_sent_at = 0.0
        self._held_status: m.DaemonStatus | None = None  # progress held back by STATUS_PROGRESS_S
        self.usage: dict[int, dict[str, dict[str, Any]]] = {}  # round -> site -> ResourceUsage, for the report
        self.update_bytes: dict[int, dict[str, int]] = {}  # round -> site -> accepted update's size, for ps/metrics

    # -- setup ----------------------------------------------------------------------------------
    def _load_state(self) -> DaemonState:
        if self.resume:
            if self.store.latest() is None:
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
                         ckpt.round - 1, self.store.latest(), state.session, where)
                return state
        elif self.store.latest() is not None:
            if not self.force:
                raise CheckpointError(
                    f"{self.store.folder} holds checkpoints of an earlier start of this run (newest: "
                    f"{self.store.latest().name}). Continue it with `fedmqtt ps start --config ... --resume`, or "
                    "start over with `--force` (removes those checkpoints)")
            removed = self.store.clear()
            log.warning("--force: removed %d checkpoint(s) of an earlier start in %s", removed, self.store.folder)
        weights, manifest = initial_model(self.config)
        extras = {}
        if self.config.pretrained is not None:
            from safetensors.numpy import load_file

            extras["pretrained"] = load_file(str(self.config.pretrained))
        session = secrets.token_hex(8)
        log.info("run %s: new session %s", self.config.run_id, session)
        state = self.machine.initial_state(weights, manifest_from_dict(manifest), extras, session=session)
        return state

    def _status_msg(self, state: str, round_no: int = 0, **kw: Any) -> m.DaemonStatus:
        c = self.config
        session = self.state.session if hasattr(self, "state") else ""
        return m.DaemonStatus(run_id=c.run_id, sender=PS, round=round_no, state=state, algorithm=c.algorithm,
                              rounds_total=c.rounds, sites_expected=c.sorted_sites, session=session,
                              quorum=c.quorum, min_sites=c.start_sites, rejected=self._rejection_summary(), **kw)

    def _rejection_summary(self) -> dict[str, dict[str, int]]:
        """Refused messages per site and reason: the channel's (malformed, spoofed, ...) and the PS's own
        (wrong round, duplicate, wrong layout, ...). Only the most frequent reasons per site, so it stays small."""
        merged: dict[str, Counter[str]] = {}
        by_site = getattr(getattr(self, "channel", None), "stats", None)
        for source in (getattr(by_site, "rejected_by_site", {}), self.rejections):
            for site, reasons in source.items():
                merged.setdefault(site, Counter()).update(reasons)
        return {site: dict(c.most_common(MAX_REASONS_SHOWN)) for site, c in sorted(merged.items())}

    def _refuse(self, site: str, category: str, detail: str) -> None:
        """Count and log one refused message (the state is left exactly as it was)."""
        self.rejections.setdefault(site, Counter())[category] += 1
        log.warning("refused a message from %s: %s", site, detail[:300])

    def start(self) -> None:
        """Load or create the state, connect, subscribe, and publish the first effects."""
        c = self.config
        self.state = self._load_state()
        will = encode(self._status_msg("offline", detail="PS disconnected"))
        self.channel = Channel.open(self._transport_factory, client_id=f"fedmqtt-ps-{c.run_id}",
                                    will=(topics.ps_status_topic(c.run_id), will), run_id=c.run_id, sender=PS)
        if hasattr(self.channel, "admit_manifest"):  # refuse a chunked upload before fetching a byte of it
            self.channel.admit_manifest = self._admit_manifest
        self.channel.connect(timeout_s=None)
        # Statuses first: retained site statuses are replayed before any retained update. These filters
        # do not match `<topic>/chunk/<i>`: chunks are fetched one transfer at a time (transport/bulk.py).
        for kind in ("status", "update", "report"):
            self.channel.transport.subscribe([topics.any_site_filter(c.run_id, kind)])
        # A hospital behind its own bridged broker: the bridge's Will "0" says its broker or link is down.
        self.channel.transport.subscribe([topics.any_bridge_filter(c.run_id)])
        if self.resume:  # turns the previous PS process granted are void: it is gone, and so is its count of them
            self.channel.bulk.publish_many((topics.ps_turn_topic(c.run_id, site), b"") for site in c.sorted_sites)
        self._apply(Started(time.time()))

    def poll(self, timeout_s: float) -> bool:
        """Handle at most one inbound message and the clock; True once the run is finished."""
        self._announce_if_reconnected()
        inbound = self.channel.receive(timeout_s)
        if inbound is not None:
            site, topic = inbound.topic.site_id or "?", inbound.topic
            event = self._event_of(inbound)
            # An accepted update's tensors are spooled by now: drop the message (as large as the model) before
            # the event may close the round, so aggregation, checkpoint and the next model do not sit beside it.
            del inbound
            if event is not None:
                self._step(event, site, topic)
        self._apply(Tick(time.time()))
        self._grant_turns()
        self._send_held_status()
        self._refresh_status()
        self._remind()
        return self.finished is not None

    # Whatever a message holds, the PS keeps serving: anything it cannot use is refused with a reason; the machine
    # is pure, so a refused event leaves the state as it was.
    def _event_of(self, inbound: Inbound) -> Event | None:
        """One checked message -> at most one event (None: nothing to do, or refused)."""
        try:
            return self._to_event(inbound)
        except (KeyError, ValueError, TypeError, ArithmeticError, OverflowError) as exc:
            self._refuse_unusable(inbound.topic.site_id or "?", inbound.topic, exc)
            return None

    def _step(self, event: Event, site: str, topic: object) -> None:
        try:
            self.state, effects = self.machine.step(self.state, event)
        except (KeyError, ValueError, TypeError, ArithmeticError, OverflowError) as exc:
            self._refuse_unusable(site, topic, exc)
            return
        self._run_effects(effects)

    def _refuse_unusable(self, site: str, topic: object, exc: BaseException) -> None:
        log.exception("refused a message from %s on %s", site, topic)
        self._refuse(site, "unusable content", f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        c = self.config
        if self.finished is None:  # say we are gone (a clean disconnect does not fire the Will)
            final = encode(self._status_msg("offline", detail="PS stopped"))
            self.channel.close(final=(topics.ps_status_topic(c.run_id), final))
        else:
            self.channel.close()

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

    def _publish_status(self, msg: m.DaemonStatus) -> None:
        """Publish a change of phase or round now; hold progress within the same phase and round back to one
        status per STATUS_PROGRESS_S (the newest one wins, see _send_held_status)."""
        last = self._last_status
        progress = last is not None and (last.state, last.round) == (msg.state, msg.round)
        if progress and time.monotonic() - self._status_sent_at < STATUS_PROGRESS_S:
            self._held_status = msg
            return
        self._send_status(msg)

    def _send_held_status(self) -> None:
        if self._held_status is not None and time.monotonic() - self._status_sent_at >= STATUS_PROGRESS_S:
            self._send_status(self._held_status)

    def _send_status(self, msg: m.DaemonStatus) -> None:
        msg = msg.model_copy(update={"upload_turns": self.turns.view()})
        self.channel.send(topics.ps_status_topic(self.config.run_id), msg)
        self._last_status, self._held_status, self._status_sent_at = msg, None, time.monotonic()

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
        base = self._held_status or self._last_status
        if base is not None:
            self._publish_status(base.model_copy(update={"sent_at": time.time()}))
        if self.turns.granted:  # debug: one line per turn; the reminder says it at info every REMIND_S
            log.debug("round %d: upload turns %s; waiting for a turn: %s", s.round, ", ".join(self.turns.view()),
                      _few(self.turns.waiting()))

    def _refresh_status(self) -> None:
        """Publish new rejection counts (at most every STATUS_REFRESH_S), so operators see who sends what."""
        now = time.monotonic()
        if self._last_status is None or now - self._status_refreshed_at < STATUS_REFRESH_S:
            return
        summary = self._rejection_summary()
        if summary == self._shown_rejections:
            return
        status = self._last_status.model_copy(update={"rejected": summary, "sent_at": time.time()})
        self.channel.send(topics.ps_status_topic(self.config.run_id), status)
        self._last_status, self._shown_rejections, self._status_refreshed_at = status, summary, now

    def _remind(self) -> None:
        """Nothing waits in silence: every REMIND_S say what the PS waits for and who is missing."""
        now = time.monotonic()
        if now - self._reminded_at < REMIND_S or self.finished is not None:
            return
        self._reminded_at = now
        s, c = self.state, self.config
        online = sorted(s.online)
        if s.phase == "waiting_for_sites":
            missing = [x for x in c.sorted_sites if x not in s.online]
            log.info("waiting for sites: %d/%d online (need %d to start); missing: %s", len(online),
                     len(c.sites), c.start_sites, ", ".join(missing) or "none")
            return
        answered = s.updates if s.phase == "training" else s.final_reports
        missing = [x for x in s.selected if x not in answered]
        left = f"{s.deadline - time.time():.0f} s" if s.deadline else "none"
        what = f"round {s.round}/{c.rounds}" if s.phase == "training" else "the final evaluation"
        log.info("%s: %d/%d answers; waiting for %s (not online: %s); deadline in %s", what, len(answered),
                 len(s.selected), ", ".join(missing) or "nobody", ", ".join(m for m in missing if m not in s.online)
                 or "none", left)
        if self.turns.ready:
            log.info("upload turns: %s; waiting for a turn: %s", ", ".join(self.turns.view()) or "none",
                     _few(self.turns.waiting()))

    def _request_stop(self, signum: int, frame: object) -> None:
        log.info("signal %d: stopping after the current step", signum)
        self._stop = True
        if hasattr(self, "channel"):
            self.channel.interrupt()

    # -- inbound --------------------------------------------------------------------------------
    def _to_event(self, inbound: Inbound) -> Event | None:
        msg, site, now = inbound.message, inbound.topic.site_id, time.time()
        if site is None:
            return None
        if isinstance(msg, BridgeState):
            if msg.up:
                log.info("site %s: its hospital broker's bridge is up", site)
                return None
            log.warning("site %s: its hospital broker or the link to it is down (bridge notification)", site)
            return SiteOffline(site, now)
        if isinstance(msg, m.SiteStatus):
            if msg.state == "offline":
                self.turns.forget(site)
                return SiteOffline(site, now)
            if msg.state == "update_ready":
                # the size only lengthens the grace of an unused turn: never beyond the largest update we take
                self.turns.announce(site, msg.round, min(msg.update_bytes, self.channel.max_bytes), now)
            if msg.state == "error":
                log.warning("site %s reports an error: %s", site, msg.detail[:500])
            if msg.label_histogram is not None and (why := histogram_rejection(msg.label_histogram)):
                self._refuse(site, "bad histogram", f"status: {why}")
                return None
            return SiteOnline(site, now, msg.n_train, _as_tuple(histogram_vector(msg.label_histogram)))
        if isinstance(msg, m.ClientUpdate):
            if msg.round == self.state.round:
                self.turns.forget(site)  # accepted or refused, its turn is over (an old round's copy changes nothing)
            why = update_rejection(self.machine, self.state, site, msg)
            if why is not None:  # judged before anything is stored: first wins, nothing on disk for other rounds
                self._refuse(site, _category(why), f"update for round {msg.round}: {why}")
                return None
            extras: dict[str, Any] = dict(msg.scalars)
            if msg.control_variates:
                extras["delta_c"] = blobs_to_arrays(msg.control_variates)
            if msg.label_histogram is not None:
                extras["label_histogram"] = dict(msg.label_histogram)
            if msg.layer_stats:
                flat = blobs_to_arrays(msg.layer_stats)
                layers = sorted({name.rsplit("/", 1)[0] for name in flat})
                try:
                    extras["feature_stats"] = {k: (flat[f"{k}/mean"], flat[f"{k}/var"]) for k in layers}
                except KeyError as exc:
                    raise ValueError(f"feature_stats lacks {exc.args[0]!r}") from None
            if msg.usage is not None:
                self.usage.setdefault(msg.round, {})[site] = msg.usage.model_dump()
            self.update_bytes.setdefault(msg.round, {})[site] = inbound.size
            tensors = self.spool.put(msg.round, site, msg.tensors)  # accepted: stored atomically, message dropped
            if inbound.chunks:  # it came in an upload turn: the site keeps it on disk and answers a new turn
                self.channel.clear_received(topics.site_update_topic(self.config.run_id, site), inbound.chunks)
                crash_point("after_update_cleared", msg.round)
            update = SiteUpdate(site, tensors, msg.n_samples, msg.local_steps, extras)
            return UpdateReceived(site, now, msg.round, msg.base_model_hash, update, msg.train_loss,
                                  msg.val_metrics, msg.undefined, msg.no_step_reason)
        if isinstance(msg, m.EvalReport):
            why = report_rejection(self.state, site, msg)
            if why is not None:
                self._refuse(site, _category(why), f"report for round {msg.round}: {why}")
                return None
            return ReportReceived(site, now, msg.round, msg.model_hash, msg.tag, msg.metrics, msg.n_samples,
                                  msg.undefined, msg.best_round)
        return None

    # -- effects --------------------------------------------------------------------------------
    def _msg_id(self, *parts: object) -> str:
        """Stable per (run, session, re-publish attempt, what): see `stable_msg_id`."""
        s = self.state
        return stable_msg_id(self.config.run_id, s.session, *(("attempt", s.attempt) if s.attempt else ()), *parts)

    def _admit_manifest(self, parsed: Any, manifest: Any) -> str | None:
        """The channel asks before fetching a chunked message; a reason refuses it (counted by the channel)."""
        why = manifest_rejection(self.machine, self.state, parsed.site_id, parsed.kind, manifest)
        if why is not None and parsed.kind == "update" and manifest.round == self.state.round:
            self.turns.forget(parsed.site_id)  # a refused upload ends its turn, as a refused update does
        return why

    def _apply(self, event: Event) -> None:
        self.state, effects = self.machine.step(self.state, event)
        self._run_effects(effects)

    def _run_effects(self, effects: list[fx.Effect]) -> None:
        """Run and release each effect in turn: a SaveCheckpoint holds the state it saves (the previous model
        too, as the best round's weights, until they are in their file), which must not stay alive while the
        next model is encoded and published."""
        saved = any(isinstance(e, fx.SaveCheckpoint) for e in effects)
        kinds = [type(e) for e in effects]  # not the effects: each is released once it has run
        effects.reverse()
        while effects:
            self._run_effect(effects.pop())
        if saved:
            self.spool.drop_before(self.state.round)
        if any(k in (fx.PublishModel, fx.SaveCheckpoint, fx.Finish) for k in kinds):
            self._map_weights()

    def _map_weights(self) -> None:
        """After a checkpoint, hold the model's large tensors as read-only maps of it; after any read of maps (a
        publish, a checkpoint, the final save), drop the pages read. Until the next aggregation only the model's
        layout is needed, and unread pages cost the PS no memory while the next updates arrive."""
        if self._model_file is not None:
            weights, path, layout = self._model_file
            self._model_file = None
            if all(self.state.weights.get(name) is weights.get(name) for name in layout):
                self.state = replace(self.state, weights={**self.state.weights, **open_maps(path, layout)})
        drop_read_pages(self.state.weights)

    def _run_effect(self, effect: fx.Effect) -> None:
        c, ch = self.config, self.channel
        if isinstance(effect, fx.SaveCheckpoint):
            state = self.store.spill_best(effect.state)
            if self.state.best is effect.state.best:  # keep only the file's name in memory from now on
                self.state = replace(self.state, best=state.best)
            path, layout = self.store.save_and_map(state_to_checkpoint(state, run_id=c.run_id,
                                                                       config_hash=c.config_hash()))
            self._model_file = (state.weights, path, layout)
            crash_point("after_checkpoint", effect.state.round - 1)
        elif isinstance(effect, fx.PublishModel):
            msg = m.GlobalModel(run_id=c.run_id, sender=PS, round=effect.round, model=c.model,
                                model_hash=effect.model_hash, tensors=arrays_to_blobs(effect.weights),
                                extras={k: arrays_to_blobs(v) for k, v in effect.extras.items()},
                                session=self.state.session, msg_id=self._msg_id("model", effect.round, effect.model_hash))
            ch.send(topics.ps_model_topic(c.run_id), msg)
        elif isinstance(effect, fx.PublishTrainTask):
            hyper = {**c.train.hyper, **c.hyper, **effect.hyper}  # train.hyper: local optimiser keys (momentum)
            settings = c.train.model_copy(update={"algorithm": c.algorithm, "seed": c.seed, "hyper": hyper})
            msg = m.TrainTask(run_id=c.run_id, sender=PS, round=effect.round, site_id=effect.site_id,
                              model_hash=effect.model_hash, deadline=effect.deadline, settings=settings,
                              accepted_round=effect.accepted_round, tensors=arrays_to_blobs(effect.tensors),
                              upload=effect.upload, best_round=effect.best_round,
                              session=self.state.session,
                              msg_id=self._msg_id("train", effect.round, effect.site_id, effect.model_hash))
            ch.send(topics.ps_task_topic(c.run_id, effect.site_id), msg)
        elif isinstance(effect, fx.PublishEvalTask):
            msg = m.EvalTask(run_id=c.run_id, sender=PS, round=effect.round, site_id=effect.site_id,
                             model_hash=effect.model_hash, accepted_round=effect.accepted_round,
                             tensors=arrays_to_blobs(effect.tensors), best_round=effect.best_round,
                             session=self.state.session,
                             msg_id=self._msg_id("eval", effect.round, effect.site_id, effect.model_hash))
            ch.send(topics.ps_task_topic(c.run_id, effect.site_id), msg)
        elif isinstance(effect, fx.PublishRecruitment):
            msg = m.RecruitmentResult(run_id=c.run_id, sender=PS, round=0, site_id=effect.site_id,
                                      recruited=effect.recruited, score=effect.score, rank=effect.rank,
                                      candidates=effect.candidates, detail=effect.detail,
                                      session=self.state.session, msg_id=self._msg_id("recruit", effect.site_id))
            ch.send(topics.ps_task_topic(c.run_id, effect.site_id), msg)
        elif isinstance(effect, fx.PublishStatus):
            msg = self._status_msg(effect.state, effect.round, waiting_for=effect.waiting_for,
                                   deadline=effect.deadline, detail=effect.detail,
                                   sites_online=tuple(sorted(self.state.online)))
            self._publish_status(msg)
        elif isinstance(effect, fx.PublishRoundMetrics):
            r = effect.record
            log.info("round %d closed: sites %s, mean val auroc %s", r.round, ",".join(r.sites), r.mean.get("auroc"))
            msg = m.RoundMetrics(run_id=c.run_id, sender=PS, round=r.round, sites=r.sites, stragglers=r.stragglers,
                                 per_site=dict(r.per_site), mean=dict(r.mean), train_loss=r.train_loss,
                                 duration_s=r.closed_at - r.started_at,
                                 usage={s: m.ResourceUsage(**u) for s, u in self.usage.get(r.round, {}).items()
                                        if s in r.sites},
                                 update_bytes={s: n for s, n in self.update_bytes.pop(r.round, {}).items()
                                               if s in r.sites})
            ch.send(topics.ps_metrics_topic(c.run_id), msg)
        elif isinstance(effect, fx.Log):
            (log.warning if effect.level == "warning" else log.info)(effect.text)
        elif isinstance(effect, fx.Finish):
            self._finish(effect.state)

    def _finish(self, state: DaemonState) -> None:
        """Write the final and best models and the report, and publish the final metrics."""
        from safetensors.numpy import save_file

        c, out = self.config, self.config.out_dir
        out.mkdir(parents=True, exist_ok=True)
        models = {"final": str(out / "final_model.safetensors")}
        final = {**state.weights, **state.extras.get("eval", {})}  # FedDyn's deployed model is theta_avg
        # safetensors writes straight from each array's memory: contiguous arrays are not copied first
        save_file({k: np.require(v, requirements="C") for k, v in final.items()}, models["final"])
        drop_read_pages(final)  # read through maps of the newest checkpoint; the best model is loaded next
        if state.best is not None:
            models["best"] = str(out / "best_model.safetensors")
            save_file({k: np.require(v, requirements="C") for k, v in best_weights(state.best).items()}, models["best"])
        t = self.channel
        traffic = {"bytes_sent": t.bytes_sent, "bytes_received": t.bytes_received,
                   "chunked_transfers": vars(t.fetcher.stats),
                   "messages_received": self.channel.stats.received, "duplicates": self.channel.stats.duplicates,
                   "rejected": dict(self.channel.stats.rejected)}
        finished_at = time.time()
        timings = {"started_at": self._started_at, "finished_at": finished_at, "total_s": finished_at - self._started_at}
        report = build_report(c, state, timings=timings, traffic=traffic, models=models, usage=self.usage)
        (out / "report.json").write_text(json.dumps(report, indent=2))
        (out / "report.md").write_text(render_markdown(report))
        (out / "per_site.csv").write_text(per_site_csv(report))
        mean_test = report["final"]["mean"].get("test", {})
        per_site = {s: e.get("metrics", {}).get("test", {}) for s, e in report["final"]["per_site"].items()}
        self.channel.send(topics.ps_metrics_topic(c.run_id), m.RoundMetrics(
            run_id=c.run_id, sender=PS, round=state.round, phase="final", sites=tuple(state.final_reports),
            per_site=per_site, mean=mean_test))
        log.info("run finished; report in %s", out / "report.json")
        self.finished = state
