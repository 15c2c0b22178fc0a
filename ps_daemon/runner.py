"""The PS's only I/O: MQTT in -> events -> `Machine.step` -> effects out (checkpoint before publish)."""

from __future__ import annotations

import hashlib
import json
import logging
import signal
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np

from fedmqtt.errors import BrokerError
from fedmqtt.faults import crash_point
from fedmqtt.recruitment import histogram_vector
from fedmqtt.transport import topics
from fedmqtt.transport.channel import Channel, Inbound
from fedmqtt.transport.mqtt import MqttTransport
from ps_daemon import effects as fx
from ps_daemon.checkpoint import CheckpointStore, checkpoint_to_state, state_to_checkpoint
from ps_daemon.config import DaemonConfig
from ps_daemon.events import Event, ReportReceived, SiteOffline, SiteOnline, Started, Tick, UpdateReceived
from ps_daemon.machine import Machine
from ps_daemon.report import build_report, render_markdown
from ps_daemon.spool import UpdateSpool
from ps_daemon.state import DaemonState
from fedmqtt.strategies import SiteUpdate, build_strategy
from fedmqtt.strategies.base import manifest_from_dict
from schemas import messages as m
from schemas.codec import encode
from schemas.tensors import arrays_to_blobs, blobs_to_arrays, tensors_hash

log = logging.getLogger("fedmqtt.ps")
PS = "ps"


def hash_weights(weights: dict) -> str:
    return tensors_hash(arrays_to_blobs(weights))


def initial_model(config: DaemonConfig) -> tuple[dict, dict]:
    """Round-1 weights and the tensor manifest from the model registry (algorithms.md 0.2).

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
    return load_file(str(out / "weights.safetensors")), json.loads((out / "manifest.json").read_text())


def _as_tuple(values: list[float] | None) -> tuple[float, ...] | None:
    return None if values is None else tuple(values)


def stable_msg_id(*parts: object) -> str:
    """Same message, same id: a resumed PS re-sends the round with the ids receivers already know."""
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:32]


class DaemonRunner:
    def __init__(self, config: DaemonConfig, *, resume: bool = False,
                 transport_factory: Callable[..., Any] | None = None) -> None:
        """`transport_factory(client_id=..., will=...)` makes the connection (default: MQTT to the broker
        in the config's credentials; `fedmqtt simulate` passes an in-process one)."""
        self.config = config
        self._transport_factory = transport_factory or (
            lambda **kw: MqttTransport(config.broker_settings(), **kw))
        self.machine = Machine(config, build_strategy(config.algorithm, config.strategy_params()), hash_weights)
        self.store = CheckpointStore(config.out_dir / "checkpoints", keep=config.keep_checkpoints)
        self.spool = UpdateSpool(config.out_dir / "spool")
        self.resume = resume
        self.finished: DaemonState | None = None
        self._stop = False
        self._started_at = time.time()
        self._seen_connects = 0
        self._last_status: m.DaemonStatus | None = None
        self.usage: dict[int, dict[str, dict[str, Any]]] = {}  # round -> site -> ResourceUsage, for the report

    # -- setup ----------------------------------------------------------------------------------
    def _load_state(self) -> DaemonState:
        if self.resume:
            ckpt = self.store.load_latest(run_id=self.config.run_id, config_hash=self.config.config_hash())
            log.info("resuming from checkpoint of round %d (%s)", ckpt.round - 1, ckpt.phase)
            return checkpoint_to_state(ckpt)
        weights, manifest = initial_model(self.config)
        extras = {}
        if self.config.pretrained is not None:
            from safetensors.numpy import load_file

            extras["pretrained"] = load_file(str(self.config.pretrained))
        return self.machine.initial_state(weights, manifest_from_dict(manifest), extras)

    def _status_msg(self, state: str, round_no: int = 0, **kw: Any) -> m.DaemonStatus:
        c = self.config
        return m.DaemonStatus(run_id=c.run_id, sender=PS, round=round_no, state=state, algorithm=c.algorithm,
                              rounds_total=c.rounds, sites_expected=c.sorted_sites, **kw)

    def start(self) -> None:
        """Load or create the state, connect, subscribe, and publish the first effects."""
        c = self.config
        self.state = self._load_state()
        will = encode(self._status_msg("offline", detail="PS disconnected"))
        self.channel = Channel.open(self._transport_factory, client_id=f"fedmqtt-ps-{c.run_id}",
                                    will=(topics.ps_status_topic(c.run_id), will), run_id=c.run_id, sender=PS)
        self.channel.connect(timeout_s=None)
        # Statuses first: retained site statuses are replayed before any retained update. These filters
        # do not match `<topic>/chunk/<i>`: chunks are fetched one transfer at a time (transport/bulk.py).
        for kind in ("status", "update", "report"):
            self.channel.transport.subscribe([topics.any_site_filter(c.run_id, kind)])
        self._apply(Started(time.time()))

    def poll(self, timeout_s: float) -> bool:
        """Handle at most one inbound message and the clock; True once the run is finished."""
        self._announce_if_reconnected()
        inbound = self.channel.receive(timeout_s)
        try:
            event = self._to_event(inbound) if inbound is not None else None
        except (KeyError, ValueError) as exc:  # well-formed but inconsistent content: drop it, keep serving
            log.warning("dropping a message from %s: %s", inbound.topic.site_id if inbound else "?", exc)
            event = None
        if event is not None:
            self._apply(event)
        self._apply(Tick(time.time()))
        return self.finished is not None

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
        # After a network loss the broker published our Will ("offline") on ps/status: restore it.
        connects = self.channel.transport.connects
        if connects != self._seen_connects:
            if self._seen_connects and self._last_status is not None:
                self.channel.send(topics.ps_status_topic(self.config.run_id), self._last_status)
            self._seen_connects = connects

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
        if isinstance(msg, m.SiteStatus):
            if msg.state == "offline":
                return SiteOffline(site, now)
            if msg.state == "error":
                log.warning("site %s reports an error: %s", site, msg.detail)
            return SiteOnline(site, now, msg.n_train, _as_tuple(histogram_vector(msg.label_histogram)))
        if isinstance(msg, m.ClientUpdate):
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
            tensors = self.spool.put(msg.round, site, msg.tensors)  # the message itself is dropped after this
            update = SiteUpdate(site, tensors, msg.n_samples, msg.local_steps, extras)
            return UpdateReceived(site, now, msg.round, msg.base_model_hash, update, msg.train_loss,
                                  msg.val_metrics, msg.undefined)
        if isinstance(msg, m.EvalReport):
            return ReportReceived(site, now, msg.round, msg.model_hash, msg.tag, msg.metrics, msg.n_samples,
                                  msg.undefined, msg.best_round)
        return None

    # -- effects --------------------------------------------------------------------------------
    def _apply(self, event: Event) -> None:
        self.state, effects = self.machine.step(self.state, event)
        for effect in effects:
            self._run_effect(effect)
        if any(isinstance(e, fx.SaveCheckpoint) for e in effects):
            self.spool.drop_before(self.state.round)

    def _run_effect(self, effect: fx.Effect) -> None:
        c, ch = self.config, self.channel
        if isinstance(effect, fx.SaveCheckpoint):
            self.store.save(state_to_checkpoint(effect.state, run_id=c.run_id, config_hash=c.config_hash()))
            crash_point("after_checkpoint", effect.state.round - 1)
        elif isinstance(effect, fx.PublishModel):
            msg = m.GlobalModel(run_id=c.run_id, sender=PS, round=effect.round, model=c.model,
                                model_hash=effect.model_hash, tensors=arrays_to_blobs(effect.weights),
                                extras={k: arrays_to_blobs(v) for k, v in effect.extras.items()},
                                msg_id=stable_msg_id(c.run_id, "model", effect.round, effect.model_hash))
            ch.send(topics.ps_model_topic(c.run_id), msg)
        elif isinstance(effect, fx.PublishTrainTask):
            hyper = {**c.hyper, **effect.hyper}
            settings = c.train.model_copy(update={"algorithm": c.algorithm, "seed": c.seed, "hyper": hyper})
            msg = m.TrainTask(run_id=c.run_id, sender=PS, round=effect.round, site_id=effect.site_id,
                              model_hash=effect.model_hash, deadline=effect.deadline, settings=settings,
                              accepted_round=effect.accepted_round, tensors=arrays_to_blobs(effect.tensors),
                              upload=effect.upload, best_round=effect.best_round,
                              msg_id=stable_msg_id(c.run_id, "train", effect.round, effect.site_id, effect.model_hash))
            ch.send(topics.ps_task_topic(c.run_id, effect.site_id), msg)
        elif isinstance(effect, fx.PublishEvalTask):
            msg = m.EvalTask(run_id=c.run_id, sender=PS, round=effect.round, site_id=effect.site_id,
                             model_hash=effect.model_hash, accepted_round=effect.accepted_round,
                             tensors=arrays_to_blobs(effect.tensors), best_round=effect.best_round,
                             msg_id=stable_msg_id(c.run_id, "eval", effect.round, effect.site_id, effect.model_hash))
            ch.send(topics.ps_task_topic(c.run_id, effect.site_id), msg)
        elif isinstance(effect, fx.PublishRecruitment):
            msg = m.RecruitmentResult(run_id=c.run_id, sender=PS, round=0, site_id=effect.site_id,
                                      recruited=effect.recruited, score=effect.score, rank=effect.rank,
                                      candidates=effect.candidates, detail=effect.detail,
                                      msg_id=stable_msg_id(c.run_id, "recruit", effect.site_id))
            ch.send(topics.ps_task_topic(c.run_id, effect.site_id), msg)
        elif isinstance(effect, fx.PublishStatus):
            msg = self._status_msg(effect.state, effect.round, waiting_for=effect.waiting_for,
                                   deadline=effect.deadline, detail=effect.detail)
            ch.send(topics.ps_status_topic(c.run_id), msg)
            self._last_status = msg
        elif isinstance(effect, fx.PublishRoundMetrics):
            r = effect.record
            log.info("round %d closed: sites %s, mean val auroc %s", r.round, ",".join(r.sites), r.mean.get("auroc"))
            msg = m.RoundMetrics(run_id=c.run_id, sender=PS, round=r.round, sites=r.sites, stragglers=r.stragglers,
                                 per_site=dict(r.per_site), mean=dict(r.mean), train_loss=r.train_loss,
                                 duration_s=r.closed_at - r.started_at)
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
        save_file({k: np.array(v, order="C") for k, v in final.items()}, models["final"])
        if state.best is not None:
            models["best"] = str(out / "best_model.safetensors")
            save_file({k: np.array(v, order="C") for k, v in state.best.weights.items()}, models["best"])
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
        mean_test = report["final"]["mean"].get("test", {})
        per_site = {s: e.get("metrics", {}).get("test", {}) for s, e in report["final"]["per_site"].items()}
        self.channel.send(topics.ps_metrics_topic(c.run_id), m.RoundMetrics(
            run_id=c.run_id, sender=PS, round=state.round, phase="final", sites=tuple(state.final_reports),
            per_site=per_site, mean=mean_test))
        log.info("run finished; report in %s", out / "report.json")
        self.finished = state
