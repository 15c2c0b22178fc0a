"""The site agent's loop: announce itself, wait for the model and its task, train or evaluate, publish.

Outbound connections only (hospital firewalls); paho reconnects by itself and re-subscribes, and
retained topics replay the latest model and task, so start order and network loss do not matter.
"""

from __future__ import annotations

import logging
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from fedmqtt import __version__
from fedmqtt.atomic import private_dir, write_atomic
from fedmqtt.errors import BrokerError
from fedmqtt.faults import crash_point
from fedmqtt.recruitment import label_histogram
from fedmqtt.secagg.weighted import Layout, layout_of, split
from fedmqtt.transport import topics
from fedmqtt.transport.channel import Channel
from fedmqtt.transport.mqtt import MqttTransport
from fedmqtt.transport.signing import Identity
from schemas import messages as m
from schemas import secagg as sw
from schemas.base import MAX_DETAIL
from schemas.codec import Encoded, decode, encode, encode_pieces
from schemas.feature_stats import FeatureStatistics
from schemas.secagg import CLIPPED_SCALAR
from schemas.tensors import arrays_to_blobs, blobs_to_arrays, tensors_hash
from site_agent.config import SiteConfig
from site_agent.data import load_site_data
from site_agent.federation_features import SiteFeatures
from site_agent.histogram_release import HistogramRelease
from site_agent.label_set import annotated_labels, label_set_for
from site_agent.local_state import BestSlot, LocalState
from site_agent.policy import epsilon_refusal, participant_refusal, task_refusal
from site_agent.privacy_ledger import LedgerError, PrivacyLedger
from site_agent.secagg_store import SecAggRecordError, SecAggStore
from site_agent.store import UplinkStore
from site_agent.uplink import Uplink

if TYPE_CHECKING:
    from site_agent.secagg_round import SiteRound
    from site_agent.trainer import Trainer, TrainResult

log = logging.getLogger("fedmqtt.site")
Task = m.TrainTask | m.EvalTask
REMIND_S = 30.0  # a waiting site says what it waits for at least this often
SECAGG_TO_SITE = (sw.SecAggRoster, sw.SecAggInbox, sw.SecAggUnmask)
SECAGG_TASK = "secagg-task"  # the uplink store's name for the train task of a round under secure aggregation


class SiteAgent:
    def __init__(self, config: SiteConfig, *, transport_factory: Callable[..., Any] | None = None,
                 identity: Identity | None = None) -> None:
        """`identity`: what this site signs with and verifies against (default: the `[signing]` table of its
        credentials; `fedmqtt simulate` passes its own, with the in-process `transport_factory`)."""
        self.config = config
        self._transport_factory = transport_factory or (lambda **kw: MqttTransport(config.broker_settings(), **kw))
        self.identity = identity if identity is not None else config.identity()
        self.features = SiteFeatures(config)  # with feature_statistics = "federated": the federation's statistics
        self.data = load_site_data(self.features.spec())
        self._notes_logged: set[str] = set()  # the data preparation notes already in this site's log
        # "auto" until torch is loaded: then the device it found (cuda or cpu), on every later status.
        self.device: str = config.device
        self._trainer: Trainer | None = None
        self._loading: Future[Trainer] | None = None
        self._open_state()
        self.session = self._recorded_session()
        self.models: dict[tuple[str, str], m.GlobalModel] = {}  # (session, model hash) -> model
        self.task: Task | None = None
        self._stop = False
        self._seen_connects = 0
        self.ps_done = False
        self._report_session: str | None = None  # our report is retained at the broker (for a resumed PS)
        self.ps_state = "not heard from"
        self._reminded_at = time.monotonic()
        self._last_work = "no task yet"
        self.secagg: SiteRound | None = None  # this site's secure aggregation of the open round, if any
        self._advertised: tuple[str, int, int] | None = None  # (session, round, try) whose keys went out
        self._inbox_while_training: sw.SecAggInbox | None = None  # masked once the update exists
        self._judged_early: tuple[str, int, str, int] | None = None  # the task `_advertise_early` last judged
        self._training = False

    def _load_trainer(self) -> None:
        """Import torch and the training code on a worker thread: the agent is online (and receiving the
        model) within a second while torch, seconds of imports, still loads."""
        if self._loading is None:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedmqtt-site-load")
            self._loading = pool.submit(_build_trainer, self.config, self.data)
            pool.shutdown(wait=False)

    @property
    def trainer(self) -> Trainer:
        """The trainer, waiting for the worker thread if torch is still loading (its error is raised here)."""
        if self._trainer is None:
            self._load_trainer()
            assert self._loading is not None
            self._trainer = self._loading.result()
            from site_agent.trainer import use_threads

            use_threads(self.config.threads)  # on this thread: torch's OpenMP setting is per thread
            self.device = self._trainer.device
        return self._trainer

    def _open_state(self) -> None:
        c = self.config
        private_dir(c.state_dir)  # uplinks, local layers and the best model are this site's alone
        self.store = UplinkStore(c.state_dir / "uplink")
        self.local = LocalState(c.state_dir / "local")
        self.best = BestSlot(c.state_dir / "best")
        # Never cleared with the rest when the PS starts afresh: the records behind it are the same.
        self.ledger = PrivacyLedger(c.state_dir / "privacy")
        self.histograms = HistogramRelease(c.state_dir / "privacy")  # the shared label counts, noised once if asked
        self._released: tuple[dict[str, int] | None] | None = None  # (what leaves,) once decided
        self.secagg_store = SecAggStore(c.state_dir / "secagg")  # round secrets, 0600: see site_agent/secagg_store.py

    def _recorded_session(self) -> str:
        path = self.config.state_dir / "session"
        return path.read_text(encoding="ascii").strip() if path.is_file() else ""

    def _join(self, session: str) -> None:
        """A task of another start of the run: local layers, control variates, the best slot and stored uplinks
        belong to the old one, and reusing them would mix two runs (same run id and seed or not)."""
        if session == self.session:
            return
        c = self.config
        if self.session:
            log.warning("run %s: the PS started afresh (session %s, was %s): clearing this site's state of the "
                        "earlier start", c.run_id, session, self.session)
            for sub in ("uplink", "local", "best", "secagg"):
                shutil.rmtree(c.state_dir / sub, ignore_errors=True)
            self._open_state()
        private_dir(c.state_dir)
        write_atomic(c.state_dir / "session", session.encode("ascii"))
        self.session = session
        log.info("joined run %s, session %s", c.run_id, session)

    def _status(self, state: m.SiteState, detail: str = "", *, round_no: int = 0,
                update_bytes: int = 0) -> m.SiteStatus:
        c, d = self.config, self.data
        hist = self._shared_histogram()
        return m.SiteStatus(run_id=c.run_id, sender=c.site_id, round=round_no, state=state, device=self.device,
                            n_train=d.n_train, n_val=d.n_val, n_test=d.n_test, label_histogram=hist,
                            detail=detail, version=__version__, update_bytes=update_bytes,
                            privacy_policy=c.privacy)

    def _current_status(self) -> m.SiteStatus:
        """What this site is now: waiting to upload (or uploaded) a large update, else online."""
        if self.features.problem is not None:  # it cannot take part in this run as configured: it says why
            return self._status("error", self.features.problem)
        ready = self.uplink.ready
        if ready is None:
            return self._status("online")
        return self._status("update_ready", f"round {ready.round}: update of {ready.nbytes} bytes stored",
                            round_no=ready.round, update_bytes=ready.nbytes)

    def start(self) -> None:
        """Connect (with an 'offline' Last Will); subscribe to the model, our task and turn, and the PS status."""
        c = self.config
        self._log_data_notes(at_start=True)  # before the broker is reached: a site that waits for it says them too
        self.status_topic = topics.site_status_topic(c.run_id, c.site_id)
        will = (self.status_topic, encode(self._status("offline", "connection lost")))
        self.channel = Channel.open(self._transport_factory, client_id=f"fedmqtt-site-{c.run_id}-{c.site_id}",
                                    will=will, run_id=c.run_id, identity=self.identity)
        self.channel.fetcher.prepare_next = True  # it holds round r's model while round r+1's arrives
        self.uplink = Uplink(self.channel, lambda: self.store, run_id=c.run_id, site_id=c.site_id)
        self.channel.connect(timeout_s=None)
        self.channel.transport.subscribe([topics.ps_status_topic(c.run_id), topics.ps_model_topic(c.run_id),
                             topics.ps_task_topic(c.run_id, c.site_id), topics.ps_turn_topic(c.run_id, c.site_id)])
        log.info("site %s online: %d train / %d val / %d test rows on %s", c.site_id, self.data.n_train,
                 self.data.n_val, self.data.n_test, self.device)
        if self.features.enabled:
            self.channel.transport.subscribe([topics.ps_features_topic(c.run_id)])
            summary = self.features.summary_or_problem()
            if summary is None:  # images, ECG records: nothing to summarise; the status (sent on connect) says so
                log.error("%s", self.features.problem)
            else:  # retained: a PS that starts later, or restarts before round 1, finds it
                self.channel.send(topics.site_features_topic(c.run_id, c.site_id), summary)
                log.info("sent this site's feature summary; training waits for the federation's statistics")
        if not self.features.waiting:  # else torch loads once the data is standardised with them
            self._load_trainer()

    def poll(self, timeout_s: float) -> None:
        """Handle at most one inbound message, then any task whose model has arrived."""
        self.receive(timeout_s)
        self.work()

    def receive(self, timeout_s: float) -> None:
        """Handle at most one inbound message (a model chunk, a task, an upload turn...); never trains."""
        self._announce_if_reconnected(self.status_topic)
        if self._trainer is None and self._loading is not None and self._loading.done():
            _ = self.trainer  # torch has loaded: take the trainer now (a failure, e.g. no CUDA, stops the agent)
        inbound = self.channel.receive(timeout_s)
        if inbound is not None:
            self._on_message(inbound.message, chunked=inbound.chunks > 0)
            self._advertise_early()

    def work(self) -> bool:
        """Train or evaluate the task whose model has arrived, if there is one (True if so)."""
        worked = self._work()
        self._remind()
        return worked

    def _remind(self) -> None:
        """Nothing waits in silence: every REMIND_S say what this site waits for."""
        now = time.monotonic()
        if now - self._reminded_at < REMIND_S or self.ps_done:
            return
        self._reminded_at = now
        if not self.channel.transport.connected:
            s = self.channel.transport.settings
            log.info("waiting for the broker at %s:%s (reconnecting by itself)", s.host, s.port)
        elif (note := self.uplink.waiting_note()) is not None:
            log.info("%s", note)
        elif self.secagg is not None and self.secagg.stage != "answered":
            log.info("round %d: secure aggregation (try %d): %s; waiting for the PS's %s (PS: %s)",
                     self.secagg.ctx.round_no, self.secagg.ctx.attempt, self.secagg.stage,
                     _NEXT_FROM_PS.get(self.secagg.stage, "next message"), self.ps_state)
        elif self.features.problem is not None:
            log.error("%s (PS: %s)", self.features.problem, self.ps_state)
        elif self.features.waiting:
            log.info("waiting for the federation's feature statistics from the PS (PS: %s)", self.ps_state)
        elif self.task is not None:
            log.info("round %d %s received; waiting for its model %s from the PS (PS: %s)", self.task.round,
                     self.task.kind, self.task.model_hash[:12], self.ps_state)
        else:
            log.info("waiting for a task from the PS (PS: %s; last: %s)", self.ps_state, self._last_work)

    def close(self) -> None:
        self.channel.close(final=(self.status_topic, encode(self._status("offline", "agent stopped"))))
        # What this site moved over MQTT in this run (bench/secagg_many.py reads it per site).
        log.info("site %s: MQTT traffic: %d bytes sent, %d bytes received", self.config.site_id,
                 self.channel.bytes_sent, self.channel.bytes_received)

    def run(self, *, exit_when_done: bool = False) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._request_stop)
        self.start()
        try:
            while not self._stop and not (exit_when_done and self.ps_done):
                self.poll(0.5)
        except BrokerError:
            if not self._stop:
                raise  # a real failure; when stopping, an interrupted publish is expected
        finally:
            self.close()

    def _request_stop(self, signum: int, frame: object) -> None:
        self._stop = True
        if hasattr(self, "channel"):
            self.channel.interrupt()

    def _announce_if_reconnected(self, status_topic: str) -> None:
        # After a network loss the broker published our Will ("offline"); say we are back.
        if self.channel.transport.connects != self._seen_connects:
            self._seen_connects = self.channel.transport.connects
            self.channel.send(status_topic, self._current_status())

    def _on_message(self, msg: object, *, chunked: bool = False) -> None:
        if isinstance(msg, m.GlobalModel):
            # A damaged or forged model is never trained on. A chunked one is proven already, in the one pass
            # over its bytes that the transfer makes: every byte matched its chunk's SHA-256 in a manifest the
            # PS signed (fedmqtt/transport/bulk.py, channel.py), so it is exactly what the PS sent, model_hash
            # included; hashing its tensors again (a second pass over the model, 10 ms at 16 MB) would only
            # re-check the PS's own arithmetic. A single message (a small model) is checked here as before.
            if not chunked and tensors_hash(msg.tensors) != msg.model_hash:
                self.channel.refusals.refused(msg.sender, "model hash", log, "refused the model of round %d: its "
                                              "tensors do not hash to %s", msg.round, msg.model_hash[:12])
                return
            self.models = {k: v for k, v in self.models.items()
                           if v.session == msg.session and v.round >= msg.round - 1}
            self.models[(msg.session, msg.model_hash)] = msg
            self.uplink.on_model(msg)
        elif isinstance(msg, m.UploadTurn):
            self.uplink.on_turn(msg)
        elif isinstance(msg, FeatureStatistics):
            self._on_statistics(msg)
        elif isinstance(msg, SECAGG_TO_SITE):
            self._on_secagg(msg)
        elif isinstance(msg, m.RecruitmentResult):
            log.info("recruitment: %s", msg.detail)
            self.channel.send(self.status_topic, self._status("online", msg.detail))
        elif isinstance(msg, (m.TrainTask, m.EvalTask)):
            newer_session = self.task is not None and msg.session != self.task.session
            if self.task is None or newer_session or msg.round >= self.task.round:
                self.task = msg
        elif isinstance(msg, m.DaemonStatus):
            self.ps_done = msg.state == "done"
            if self.ps_done and msg.session == self._report_session:
                # The PS has written its outputs: our report needs no retained copy for a resumed PS any more
                self.channel.clear(topics.site_report_topic(self.config.run_id, self.config.site_id))
                self._report_session = None
                log.info("the PS has finished: removed our report from the broker")
            self.ps_state = f"{msg.state}, round {msg.round}"
            if msg.detail:
                log.info("PS: %s (round %d) %s", msg.state, msg.round, msg.detail[:300])
            self.uplink.on_ps_status(msg)

    def _on_statistics(self, msg: FeatureStatistics) -> None:
        """The federation's feature statistics: checked, kept, and the data standardised with them from now on."""
        why = self.features.refusal(msg, tuple(self.data.feature_names))
        if why is not None:
            self.channel.refusals.refused(msg.sender, "feature statistics", log, "refused the feature statistics: %s",
                                          why)
            return
        if self._training or not self.features.keep(msg):
            return  # the same ones again (retained, after a reconnect); never swapped under a running round
        self.data = load_site_data(self.features.spec())
        self._trainer, self._loading = None, None  # the trainer holds the data it was built with
        self._load_trainer()
        log.info("standardising with the federation's feature statistics of sites %s (%d columns)",
                 ", ".join(msg.sites[:8]) + (" ..." if len(msg.sites) > 8 else ""), len(msg.columns))
        self._log_data_notes()

    def _log_data_notes(self, *, at_start: bool = False) -> None:
        """What preparing this site's data did to it (values outside plausible ranges made missing, per column;
        columns constant in train set to 0; values clipped...), each note once, for the hospital's IT to read in
        the site's own log (they never leave the site). Data standardised again with the federation's statistics
        adds only its new notes."""
        new = [note for note in self.data.notes if note not in self._notes_logged]
        for note in new:
            log.info("site %s data preparation: %s", self.config.site_id, note)
        if at_start and not new:
            log.info("site %s data preparation: no notes", self.config.site_id)
        self._notes_logged.update(new)

    def _work(self) -> bool:
        task = self.task
        if task is None or (task.session, task.model_hash) not in self.models:
            return False  # the model this task names has not arrived yet
        if self.features.waiting:
            return False  # trains only on data standardised with the federation's statistics
        self.task = None
        self._join(task.session)
        model = self.models[(task.session, task.model_hash)]
        # A task that arrives again under a new message id (the PS re-published a stalled round) is served
        # again: a train task re-sends the stored update (never trains twice), an eval task re-evaluates.
        self._last_work = f"round {task.round} {task.kind}"
        try:
            if isinstance(task, m.TrainTask):
                self._train(task, model)
            elif task.tag == m.ROUND_VALIDATION_TAG:
                self._validate_round(task, model)
            else:
                self._evaluate(task, model)
        except (ValueError, RuntimeError, KeyError, TypeError, IndexError, ArithmeticError) as exc:
            # E.g. training diverged to NaN (the schemas refuse to carry it), a model/data mismatch or a task
            # that does not fit its model: say so on our status, where the PS and observers see it, keep serving.
            log.exception("round %d %s failed", task.round, task.kind)
            status = self._status("error", f"round {task.round} {task.kind} failed: {exc}"[:500])
            self.channel.send(topics.site_status_topic(self.config.run_id, self.config.site_id), status)
        return True

    def _compose(self, model: m.GlobalModel, task: Task, *, evaluate: bool = False) -> dict[str, np.ndarray]:
        """The model this site uses: received shared tensors, then its personalised tensors, then its
        own local layers; anything never received nor kept (a site joining after round 1) takes the
        registry's round-1 value, which every site can rebuild from the run seed.

        The received tensors are read-only views of the message (no copy of the model each round): the trainer
        copies them into torch, the best slot writes them out, and nothing writes into them (numpy would
        refuse)."""
        weights = blobs_to_arrays(model.tensors)
        if evaluate and "eval" in model.extras:  # FedDyn: validate theta_avg, train from theta_send
            weights.update(blobs_to_arrays(model.extras["eval"]))
        weights.update(blobs_to_arrays(task.tensors))
        names = self.trainer.manifest(model.model)
        for name, value in self.local.committed().get("model", {}).items():
            weights.setdefault(name, value)
        missing = [n for n in names if n not in weights]
        if missing:
            log.warning("no local value for %d tensors (e.g. %s): using the round-1 initialisation",
                        len(missing), missing[0])
            from fedmqtt.training.weights import initial_arrays

            init = initial_arrays(model.model.name, dict(model.model.args), self._run_seed(task))
            weights.update({n: init[n] for n in missing})
        return weights

    @staticmethod
    def _run_seed(task: Task) -> int:
        return task.settings.seed if isinstance(task, m.TrainTask) else 0

    def _train(self, task: m.TrainTask, model: m.GlobalModel) -> None:
        c = self.config
        stored = self.store.load("update", task.round, task.model_hash)
        if stored is not None and task.secure_aggregation is not None:
            log.info("round %d: trained before; secure aggregation try %d with the stored update", task.round,
                     task.secure_aggregation.attempt)
            self._secure_offer(task, decode(stored, max_bytes=self.channel.max_bytes))
            return
        if stored is not None:  # trained before a restart: re-send, never train twice
            log.info("round %d: re-publishing the stored update", task.round)
            self._offer_update(task, stored, None)
            return
        self.local.resolve(task.accepted_round, task.round)
        self.best.promote(task.best_round)
        refusal = self._refusal(task, model)
        if refusal is not None:  # checked before a single record is touched
            self._refuse(task, refusal)
            return
        self.channel.send(topics.site_status_topic(c.run_id, c.site_id),
                          self._status("training", f"round {task.round}"))
        start = self._compose(model, task)
        eval_weights = self._compose(model, task, evaluate=True) if "eval" in model.extras else None
        self.best.remember(task.round, eval_weights if eval_weights is not None else start)
        extras = {k: _arrays(v) for k, v in model.extras.items() if k != "eval"}
        dp_history = self.ledger.history() if task.settings.dp is not None else []
        secure = task.secure_aggregation is not None and self._secure_advertise(task, start)
        with self._serving_while_training(secure):  # (sets _training)
            result = self.trainer.train(model.model, start, task.settings, task.round, eval_weights=eval_weights,
                                        extras=extras, local=self.local.committed(), dp_history=dp_history)
        privacy = result.privacy
        if result.dp_history is not None:  # spent once trained: recorded before anything leaves the site
            self.ledger.save(result.dp_history)
            if privacy is not None and (pure := self.ledger.pure_epsilon()):  # a Laplace release, composed basically
                privacy = privacy.model_copy(update={"epsilon": privacy.epsilon + pure})
        if result.no_step_reason:
            self._answer_without_update(task, result)
            return
        upload = sorted(result.weights) if task.upload is None else list(task.upload)
        kept = {n: v for n, v in result.weights.items() if n not in set(upload)}
        shared = {n: result.weights[n] for n in upload}
        if task.secure_aggregation is not None and task.secure_aggregation.distributed_dp is not None:
            from site_agent.distributed_dp import model_change

            shared = model_change(shared, start)  # distributed DP sums changes, clipped and noised when masked
        self.local.stage(task.round, {"model": kept, **result.algo_state})  # pending, before the uplink
        update = m.ClientUpdate(
            run_id=c.run_id, sender=c.site_id, round=task.round, session=task.session, base_model_hash=task.model_hash,
            tensors=arrays_to_blobs(shared), n_samples=result.n_samples,
            local_steps=result.steps, train_loss=result.train_loss, val_metrics=result.val_metrics,
            undefined=result.undefined, compute_seconds=result.seconds, usage=result.usage,
            control_variates=arrays_to_blobs(result.uplink_extras.get("delta_c", {})),
            scalars={k: float(v) for k, v in result.uplink_extras.items() if k not in ("delta_c", "feature_stats")},
            layer_stats=_stats_blobs(result.uplink_extras.get("feature_stats", {})),
            label_histogram=self._histogram(task), privacy=privacy,
            label_set=label_set_for(task.per_label_tensors, shared, self.data.task.kind, self.data.y_train),
        )
        # As pieces (the tensors stay in the trained arrays): the store writes them one after another and the
        # channel cuts chunks from them, so the update is never joined into one more model-sized copy.
        payload = encode_pieces(update, max_bytes=self.channel.max_bytes)
        self.store.save("update", task.round, task.model_hash, payload)  # durable before it leaves
        log.info("round %d: trained %d steps in %.2f s, val auroc %s", task.round, result.steps, result.seconds,
                 result.val_metrics.get("auroc"))
        if update.label_set is not None:
            log.info("round %d: output layer averaged label by label; this site annotates %d of %d labels (its label "
                     "set)", task.round, len(update.label_set), np.shape(shared[task.per_label_tensors[0]])[0])
        if task.secure_aggregation is not None:
            self._secure_offer(task, update)
            return
        self._offer_update(task, payload, update)

    # -- secure aggregation (docs/secure-aggregation.md) ----------------------------------------------------
    def _advertise_early(self) -> None:
        """As soon as a train task under secure aggregation and its model are here, advertise this try's keys
        (not only when training starts): the PS's roster and this site's shares then overlap whatever comes before
        training, such as torch's start-up or, with several agents in one process (site_agent/multi.py), the
        others' training. Only for a task of the session this site has joined (joining another clears the round
        secrets) and once torch is loaded (to judge the task first: a site that will refuse it advertises
        nothing)."""
        task = self.task
        if self._training or not isinstance(task, m.TrainTask) or task.secure_aggregation is None \
                or task.session != self.session or self._trainer is None:
            return
        key = (task.session, task.round, task.model_hash, task.secure_aggregation.attempt)
        model = self.models.get((task.session, task.model_hash))
        if model is None or self._judged_early == key:
            return
        self._judged_early = key
        if self._advertised == (task.session, task.round, task.secure_aggregation.attempt) \
                or self._refusal(task, model) is not None:
            return
        self._secure_advertise(task, {**blobs_to_arrays(model.tensors), **blobs_to_arrays(task.tensors)})

    def _secure_advertise(self, task: m.TrainTask, start: dict[str, np.ndarray]) -> bool:
        """Before training: advertise this try's keys, so that the PS's roster (and this site's sealed shares,
        sent from it while training runs) are done by the time the update is; after training only the masked
        input and the unmasking answer remain. The layout is the shape of what this site will upload (if it turns
        out otherwise, `_secure_offer` rebuilds the round with the same secrets); the secrets are on disk before
        the advertisement leaves. False: not advertised (tried again after training)."""
        from fedmqtt.secagg.site import SecAggRefused  # (a site loads the protocol's code when a task asks for it)

        assert task.secure_aggregation is not None
        sr, attempt = self.secagg, task.secure_aggregation.attempt
        if self._advertised == (task.session, task.round, attempt) and sr is not None \
                and (sr.session, sr.ctx.round_no, sr.ctx.attempt) == (task.session, task.round, attempt):
            return True  # advertised early, when the task and its model arrived
        upload = set(task.upload) if task.upload is not None else set(start)
        floats, _ = split({n: v for n, v in start.items() if n in upload})
        try:
            self.store.save(SECAGG_TASK, task.round, "", encode(task, max_bytes=self.channel.max_bytes))
            self.secagg = self._secure_round(task, floats)
        except (SecAggRefused, SecAggRecordError, ValueError) as exc:
            log.warning("round %d: secure aggregation: could not advertise keys before training (%s); trying "
                        "again once trained", task.round, exc)
            self.secagg = None
            return False
        self._send_advert(task)
        return True

    def _send_advert(self, task: m.TrainTask) -> None:
        assert self.secagg is not None and task.secure_aggregation is not None
        c = self.config
        self.channel.send(topics.site_secagg_topic(c.run_id, c.site_id), self.secagg.advert())
        self._advertised = (task.session, task.round, task.secure_aggregation.attempt)
        log.info("round %d: secure aggregation try %d: keys advertised; the update leaves only masked",
                 task.round, task.secure_aggregation.attempt)

    @contextmanager
    def _serving_while_training(self, serve: bool) -> Iterator[None]:
        """While this thread trains, a second one handles what arrives (`serve`: under secure aggregation), so
        that the PS's roster is answered with this site's sealed shares at once, not after training. This thread
        does not touch the channel or the secure-aggregation records until the other has stopped (joined); an
        inbox that arrives meanwhile waits for the update (`_inbox_while_training`)."""
        if not serve:
            yield
            return
        done = threading.Event()
        self._training = True

        from fedmqtt.secagg.site import SecAggRefused

        def handle_arrivals() -> None:
            while not done.is_set() and not self._stop:
                try:
                    self.receive(0.1)
                except BrokerError:
                    return  # the channel is closing (the agent stops); training finishes on its own
                except (SecAggRefused, SecAggRecordError, ValueError, KeyError, TypeError) as exc:
                    log.warning("while training: a message could not be handled: %s", exc)

        helper = threading.Thread(target=handle_arrivals, name=f"fedmqtt-site-{self.config.site_id}-arrivals",
                                  daemon=True)
        helper.start()
        try:
            yield
        finally:
            done.set()
            helper.join()
            self._training = False

    def _secure_offer(self, task: m.TrainTask, update: object) -> None:
        """Trained under secure aggregation: tell the PS how (the update without tensors) and, unless done before
        training, advertise this try's keys; the tensors leave only masked, once the PS sends the inbox
        (`_on_secagg`; at once if it arrived while training)."""
        assert isinstance(update, m.ClientUpdate) and task.secure_aggregation is not None
        c, attempt = self.config, task.secure_aggregation.attempt
        if update.no_step_reason:  # a stored answer without a step: it is the answer again, nothing to mask
            self._offer_update(task, encode(update, max_bytes=self.channel.max_bytes), update)
            return
        self.store.save(SECAGG_TASK, task.round, "", encode(task, max_bytes=self.channel.max_bytes))
        floats, _ = split(_arrays(update.tensors))
        sr = self.secagg
        if sr is None or (sr.session, sr.ctx.round_no, sr.ctx.attempt) != (task.session, task.round, attempt) \
                or sr.layout != self._layout(task, floats):  # the same secrets again from the store, if any
            self.secagg = self._secure_round(task, floats)
        told = update.model_copy(update={"tensors": (), "control_variates": (), "layer_stats": (),
                                         "scalars": self._clipped_note(task, update)})
        self.channel.send(topics.site_update_topic(c.run_id, c.site_id), told)
        if self._advertised != (task.session, task.round, attempt):
            self._send_advert(task)
        inbox, self._inbox_while_training = self._inbox_while_training, None
        if inbox is not None and (inbox.round, inbox.attempt) == (task.round, attempt):
            self._on_secagg(inbox)

    def _clipped_note(self, task: m.TrainTask, update: m.ClientUpdate) -> dict[str, float]:
        """The one scalar an update under secure aggregation carries: how many coordinates of what this site masks
        the ring's range clips (CLIPPED_SCALAR; the PS warns and reports it). Warned about here too."""
        assert self.secagg is not None
        try:
            clipped = self.secagg.clipped(*self._masking_inputs(self.secagg, update))
        except ValueError:
            return {}  # it cannot be masked at all: the inbox step says why
        if clipped:
            log.warning("round %d: secure aggregation: %d of %d coordinates of this site's weighted update lie "
                        "outside the ring's range [-%g, %g] and are clipped: the sum is off by more than the "
                        "encoding's bound (raise secure_aggregation.clip at the PS)", task.round, clipped,
                        self.secagg.layout.length, self.secagg.fixed.clip, self.secagg.fixed.clip)
        return {CLIPPED_SCALAR: float(clipped)}

    @staticmethod
    def _masking_inputs(sr: SiteRound, update: m.ClientUpdate) -> tuple[
            dict[str, np.ndarray], int, dict[str, np.ndarray] | None, tuple[float, float, float] | None]:
        """What this site masks, from its update: its float tensors, its count, SCAFFOLD's delta_c and FedNova's
        local work when the layout has them."""
        floats, _ = split(_arrays(update.tensors))
        variates = _arrays(update.control_variates) if sr.layout.variates else None  # SCAFFOLD's delta_c
        # FedNova's local work: ||a_i||_1 as the update reports it (plain SGD: its steps), and its steps
        work = (float(update.scalars.get("a_norm", update.local_steps)), float(update.local_steps), sr.work_bound)
        return floats, update.n_samples, variates, work if sr.layout.normalised else None

    @staticmethod
    def _layout(task: m.TrainTask, floats: dict[str, np.ndarray]) -> Layout:
        assert task.secure_aggregation is not None
        return layout_of(floats, variates=task.secure_aggregation.variates,
                         normalised=task.secure_aggregation.normalised, rows=task.secure_aggregation.per_label_tensors)

    def _secure_round(self, task: m.TrainTask, floats: dict[str, np.ndarray]) -> SiteRound:
        assert task.secure_aggregation is not None
        layout = self._layout(task, floats)
        d = self.data
        mask = annotated_labels(d.task.kind, d.y_train, layout.labels) if layout.labels else None
        if mask is not None:
            log.info("round %d: secure aggregation: output rows summed label by label; this site annotates %d of "
                     "%d labels", task.round, int(mask.sum()), layout.labels)
        from site_agent.secagg_round import SiteRound

        return SiteRound(self.secagg_store, self.identity, run_id=self.config.run_id, session=task.session,
                         round_no=task.round, terms=task.secure_aggregation, layout=layout, label_mask=mask,
                         min_noise_multiplier=self.config.privacy.min_participant_noise_multiplier)

    def _secagg_for(self, msg: sw.SecAggRoster | sw.SecAggInbox | sw.SecAggUnmask
                    ) -> tuple[SiteRound, m.TrainTask, m.ClientUpdate | None] | None:
        """This site's round the PS's message belongs to: the open one (advertised before training: its update
        may not exist yet, None), or (after a restart) the one its stored task and update rebuild. None: a round
        this site did not train under secure aggregation."""
        raw_task = self.store.load(SECAGG_TASK, msg.round, "")
        task = decode(raw_task, max_bytes=self.channel.max_bytes) if raw_task is not None else None
        if not isinstance(task, m.TrainTask) or task.secure_aggregation is None \
                or task.secure_aggregation.attempt != msg.attempt:
            return None
        raw_update = self.store.load("update", task.round, task.model_hash)
        update = decode(raw_update, max_bytes=self.channel.max_bytes) if raw_update is not None else None
        if not isinstance(update, m.ClientUpdate):
            update = None
        sr = self.secagg
        if sr is None or (sr.ctx.round_no, sr.ctx.attempt, sr.session) != (task.round, msg.attempt, task.session):
            if update is None:
                return None
            sr = self.secagg = self._secure_round(task, split(_arrays(update.tensors))[0])
        return sr, task, update

    def _on_secagg(self, msg: sw.SecAggRoster | sw.SecAggInbox | sw.SecAggUnmask) -> None:
        c = self.config
        try:
            found = self._secagg_for(msg)
            if found is None:
                log.info("round %d: secure aggregation %s for try %d ignored: not a try this site trained for",
                         msg.round, msg.kind, msg.attempt)
                return
            sr, _, update = found
            if isinstance(msg, sw.SecAggRoster):
                shares = sr.on_roster(msg)
                if shares is not None:
                    self.channel.send(topics.site_secagg_topic(c.run_id, c.site_id), shares)
                    log.info("round %d: secure aggregation: sealed shares sent to %d neighbours", msg.round,
                             len(shares.shares))
            elif isinstance(msg, sw.SecAggInbox):
                if update is None:  # still training: masked once the update exists (`_secure_offer`)
                    self._inbox_while_training = msg
                    log.info("round %d: secure aggregation: the inbox arrived while training; masking once "
                             "trained", msg.round)
                    return
                if update.no_step_reason:
                    log.info("round %d: secure aggregation: no training step, so no masked input (the PS "
                             "removes this site's masks)", msg.round)
                    return
                masked = sr.on_inbox(msg, *self._masking_inputs(sr, update))
                self.channel.send(topics.site_update_topic(c.run_id, c.site_id), masked)
                log.info("round %d: secure aggregation: masked update sent (paired with %d neighbours)", msg.round,
                         len(masked.paired_with))
                crash_point("site_after_masked", msg.round)
            else:
                answer = sr.on_unmask(msg)
                self.channel.send(topics.site_secagg_topic(c.run_id, c.site_id), answer)
                log.info("round %d: secure aggregation: unmasking answer sent (%d seed and %d key shares)",
                         msg.round, len(answer.seed_shares), len(answer.mask_key_shares))
        except (_secagg_refused(), SecAggRecordError, ValueError) as exc:
            log.warning("round %d: secure aggregation: refused the PS's %s: %s", msg.round, msg.kind, exc)
            self.channel.send(self.status_topic, self._status(
                "online", f"round {msg.round}: secure aggregation: refused the PS's {msg.kind}: {exc}"[:MAX_DETAIL]))

    def _refusal(self, task: m.TrainTask, model: m.GlobalModel) -> str | None:
        """Why this site will not train `task`: its privacy policy, or a model or settings record-level DP cannot
        train, or a damaged privacy ledger. None: train."""
        policy = self.config.privacy
        dp = task.settings.dp
        why = task_refusal(policy, task, model.model, self.trainer.records()) or participant_refusal(
            policy, task, lambda terms: _run_epsilon(task, model, terms), _noise_for)
        if why is not None or dp is None:
            return why
        try:
            history, pure = self.ledger.history(), self.ledger.pure_epsilon()
        except LedgerError as exc:
            return str(exc)
        problem, plan = self.trainer.dp_plan(model.model, task.settings, history)
        if problem is not None or plan is None:
            return f"cannot train with record-level DP: {problem}"
        # pure-epsilon releases (a Laplace label histogram) add to the Gaussian history's epsilon
        return epsilon_refusal(policy, task.round, plan.epsilon_before + pure, plan.epsilon_after + pure, dp.delta)

    def _refuse(self, task: m.TrainTask, reason: str) -> None:
        """Answer the round without an update, with the reason: the PS closes it without this site and shows why
        (ps/status "dropped", its log, the round's record). Not stored: a re-sent task is judged again, under the
        policy of that moment."""
        c = self.config
        log.warning("round %d: %s", task.round, reason)
        answer = m.ClientUpdate(
            run_id=c.run_id, sender=c.site_id, round=task.round, session=task.session, base_model_hash=task.model_hash,
            tensors=(), n_samples=0, local_steps=0, no_step_reason=reason[:MAX_DETAIL])
        self.uplink.offer(task, encode(answer, max_bytes=self.channel.max_bytes), answer)
        self.channel.send(self.status_topic, self._status("online", f"round {task.round}: {reason}"[:MAX_DETAIL]))

    def _answer_without_update(self, task: m.TrainTask, result: TrainResult) -> None:
        """No optimiser step was possible (too few rows): say so, with the validation of the received model,
        instead of an update; the PS closes the round without us. Stored like an update, so a re-sent task gets
        the same answer. Nothing is staged: our state did not change."""
        c = self.config
        log.warning("round %d: no training step possible: %s; answering without an update", task.round,
                    result.no_step_reason)
        answer = m.ClientUpdate(
            run_id=c.run_id, sender=c.site_id, round=task.round, session=task.session, base_model_hash=task.model_hash,
            tensors=(), n_samples=result.n_samples, local_steps=0, val_metrics=result.val_metrics,
            undefined=result.undefined, compute_seconds=result.seconds, usage=result.usage,
            label_histogram=self._histogram(task), no_step_reason=result.no_step_reason)
        payload = encode(answer, max_bytes=self.channel.max_bytes)
        self.store.save("update", task.round, task.model_hash, payload)
        self._offer_update(task, payload, answer)

    def _offer_update(self, task: m.TrainTask, payload: Encoded, update: m.ClientUpdate | None) -> None:
        if self.uplink.offer(task, payload, update):  # large: announce it, send it in the PS's upload turn
            self.channel.send(self.status_topic, self._current_status())
            self.uplink.take_turn()

    def _histogram(self, task: m.TrainTask) -> dict[str, int] | None:
        """Label counts leave the site only if its egress policy allows it; FedDkw cannot run without."""
        if self.config.share_label_histogram:
            return self._shared_histogram()
        if task.settings.algorithm == "feddkw":
            raise ValueError("feddkw needs the label histogram, but this site's egress policy "
                             "(share_label_histogram = false) does not allow it to leave")
        return None

    def _shared_histogram(self) -> dict[str, int] | None:
        """The label counts this site's egress policy lets leave: exact, or (policy `label_histogram_epsilon`)
        the one noised release, charged to the ledger (site_agent/histogram_release.py); decided once a start."""
        c, d = self.config, self.data
        if not c.share_label_histogram:
            return None
        if self._released is None:
            exact = label_histogram(d.task.kind, d.y_train, d.task.n_outputs)
            self._released = (self.histograms.shared(exact, c.privacy, d.task.kind, self.ledger),)
        return self._released[0]

    def _validate_round(self, task: m.EvalTask, model: m.GlobalModel) -> None:
        """evaluation = "all": validate round `task.round`'s global model although this site does not train in
        that round, as a selected site does before training: first promote the best round the PS names, then keep
        this model as the one evaluated last, so that the best slot follows the PS's best round here too; the
        scores go back as a report with the task's tag."""
        c = self.config
        self.best.promote(task.best_round)
        weights = self._compose(model, task, evaluate=True)  # FedDyn: theta_avg, as the best round keeps
        self.best.remember(task.round, weights)
        metrics, counts, undefined = self.trainer.evaluate(model.model, weights, ("val",))
        report = m.EvalReport(run_id=c.run_id, sender=c.site_id, round=task.round, session=task.session,
                              model_hash=task.model_hash, tag=task.tag, metrics=metrics, n_samples=counts,
                              undefined=undefined)
        self.channel.send(topics.site_report_topic(c.run_id, c.site_id), report)
        self._report_session = task.session  # removed from the broker once the PS has finished
        self.channel.send(topics.site_status_topic(c.run_id, c.site_id),
                          self._status("online", f"round {task.round}: validated the round's model"))
        log.info("round %d: validated model %s (not training this round): val %s", task.round,
                 task.model_hash[:8], metrics.get("val"))

    def _evaluate(self, task: m.EvalTask, model: m.GlobalModel) -> None:
        c = self.config
        self.local.resolve(task.accepted_round, task.round)
        self.best.promote(task.best_round)
        weights = self._compose(model, task, evaluate=True)
        metrics, counts, undefined = self.trainer.evaluate(model.model, weights, task.splits)
        best_round, best_weights = self.best.slot()
        if best_weights is not None:  # Hwang et al.: the best round's own (composed) model, on the same splits
            if same_weights(best_weights, weights):  # the best round is the last: the same bits score the same
                best, why = dict(metrics), dict(undefined)
            else:
                best, _, why = self.trainer.evaluate(model.model, best_weights, task.splits)
            metrics.update({f"best.{split}": values for split, values in best.items()})
            undefined.update({f"best.{k}": v for k, v in why.items()})
        report = m.EvalReport(run_id=c.run_id, sender=c.site_id, round=task.round, session=task.session,
                              model_hash=task.model_hash,
                              tag=task.tag, metrics=metrics, n_samples=counts, undefined=undefined,
                              best_round=best_round)
        self.channel.send(topics.site_report_topic(c.run_id, c.site_id), report)
        self._report_session = task.session
        self.channel.send(topics.site_status_topic(c.run_id, c.site_id),
                          self._status("online", "final model evaluated"))
        log.info("evaluated model %s: test %s", task.model_hash[:8], metrics.get("test"))


_NEXT_FROM_PS = {"advertised": "roster", "shared": "inbox of sealed shares", "masked": "unmasking request"}


# The secure-aggregation and participant-DP code is loaded when a task uses it, not when a site starts (about 30 ms
# of CPU of a site process's imports, issue 30).
def _secagg_refused() -> type[Exception]:
    from fedmqtt.secagg.site import SecAggRefused

    return SecAggRefused


def _run_epsilon(task: m.TrainTask, model: m.GlobalModel, terms: m.ParticipantDP) -> tuple[float, str]:
    from site_agent.distributed_dp import run_epsilon

    return run_epsilon(task, model, terms)


def _noise_for(epsilon: float, rounds: int, delta: float) -> float | None:
    from fedmqtt.participant_dp import noise_for

    return noise_for(epsilon, rounds, delta)


def same_weights(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    """Whether two models hold the same tensors bit for bit (dtype, shape and bytes; NaN never counts as equal).
    Evaluation is a pure function of the weights (eval mode, no gradients), so equal weights score equally."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and bool(np.array_equal(a[k], b[k])) for k in a)


def _build_trainer(config: SiteConfig, data: Any) -> Trainer:
    from site_agent.trainer import Trainer, pick_device

    return Trainer(config.site_id, data, device=pick_device(config.device), amp=config.amp)


def _stats_blobs(stats: dict[str, tuple[np.ndarray, np.ndarray]]) -> tuple:
    flat = {}
    for layer, (mean, var) in stats.items():
        flat[f"{layer}/mean"] = np.asarray(mean, np.float64)
        flat[f"{layer}/var"] = np.asarray(var, np.float64)
    return arrays_to_blobs(flat)


def _arrays(blobs: tuple) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in blobs_to_arrays(blobs).items()}


__all__ = ["SiteAgent"]
