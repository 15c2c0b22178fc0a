"""The site agent's loop: announce itself, wait for the model and its task, train or evaluate, publish.

Outbound connections only (hospital firewalls); paho reconnects by itself and re-subscribes, and
retained topics replay the latest model and task, so start order and network loss do not matter.
"""

from __future__ import annotations

import logging
import signal

import torch

from fedmqtt import __version__
from fedmqtt.errors import BrokerError
from fedmqtt.transport import topics
from fedmqtt.transport.channel import Channel
from fedmqtt.transport.mqtt import MqttTransport
from schemas import messages as m
from schemas.codec import encode
from schemas.tensors import arrays_to_blobs, blobs_to_arrays
from site_agent.config import SiteConfig
from site_agent.data import load_site_data
from site_agent.store import UplinkStore
from site_agent.trainer import Trainer, pick_device

log = logging.getLogger("fedmqtt.site")
Task = m.TrainTask | m.EvalTask


class SiteAgent:
    def __init__(self, config: SiteConfig) -> None:
        self.config = config
        torch.set_num_threads(config.threads)
        self.data = load_site_data(config.data)
        self.device = pick_device(config.device)
        self.trainer = Trainer(config.site_id, self.data, device=self.device)
        self.store = UplinkStore(config.state_dir / "uplink")
        self.models: dict[str, m.GlobalModel] = {}
        self.task: Task | None = None
        self.done: set[tuple[str, int, str]] = set()  # (kind, round, model hash) handled this process
        self._stop = False
        self._seen_connects = 0
        self.ps_done = False

    def _status(self, state: str, detail: str = "") -> m.SiteStatus:
        c, d = self.config, self.data
        hist = d.label_histogram() if c.share_label_histogram else None
        return m.SiteStatus(run_id=c.run_id, sender=c.site_id, round=0, state=state, device=self.device,
                            n_train=d.n_train, n_val=d.n_val, n_test=d.n_test, label_histogram=hist,
                            detail=detail, version=__version__)

    def run(self, *, exit_when_done: bool = False) -> None:
        c = self.config
        status_topic = topics.site_status_topic(c.run_id, c.site_id)
        will = (status_topic, encode(self._status("offline", "connection lost")))
        transport = MqttTransport(c.broker_settings(), client_id=f"fedmqtt-site-{c.run_id}-{c.site_id}", will=will)
        self.channel = Channel(transport, run_id=c.run_id, sender=c.site_id)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._request_stop)
        transport.connect(timeout_s=None)
        transport.subscribe([topics.ps_status_topic(c.run_id), topics.ps_model_topic(c.run_id),
                             topics.ps_task_topic(c.run_id, c.site_id)])
        log.info("site %s online: %d train / %d val / %d test rows on %s", c.site_id, self.data.n_train,
                 self.data.n_val, self.data.n_test, self.device)
        try:
            while not self._stop and not (exit_when_done and self.ps_done):
                self._announce_if_reconnected(status_topic)
                inbound = self.channel.receive(0.5)
                if inbound is not None:
                    self._on_message(inbound.message)
                self._work()
        except BrokerError:
            if not self._stop:
                raise  # a real failure; when stopping, an interrupted publish is expected
        finally:
            transport.close(final=(status_topic, encode(self._status("offline", "agent stopped"))))

    def _request_stop(self, signum: int, frame: object) -> None:
        self._stop = True
        if hasattr(self, "channel"):
            self.channel.transport.interrupt()

    def _announce_if_reconnected(self, status_topic: str) -> None:
        # After a network loss the broker published our Will ("offline"); say we are back.
        if self.channel.transport.connects != self._seen_connects:
            self._seen_connects = self.channel.transport.connects
            self.channel.send(status_topic, self._status("online"))

    def _on_message(self, msg: object) -> None:
        if isinstance(msg, m.GlobalModel):
            self.models = {k: v for k, v in self.models.items() if v.round >= msg.round - 1}
            self.models[msg.model_hash] = msg
        elif isinstance(msg, (m.TrainTask, m.EvalTask)):
            if self.task is None or msg.round >= self.task.round:
                self.task = msg
        elif isinstance(msg, m.DaemonStatus):
            self.ps_done = msg.state == "done"
            if msg.detail:
                log.info("PS: %s (round %d) %s", msg.state, msg.round, msg.detail)

    def _work(self) -> None:
        task = self.task
        if task is None or task.model_hash not in self.models:
            return  # the model this task names has not arrived yet
        key = (task.kind, task.round, task.model_hash)
        self.task = None
        if key in self.done:
            return
        model = self.models[task.model_hash]
        try:
            if isinstance(task, m.TrainTask):
                self._train(task, model)
            else:
                self._evaluate(task, model)
        except (ValueError, RuntimeError) as exc:
            # E.g. training diverged to NaN (the schemas refuse to carry it) or a model/data mismatch:
            # say so on our status, where the PS and observers see it, and keep serving.
            log.exception("round %d %s failed", task.round, task.kind)
            status = self._status("error", f"round {task.round} {task.kind} failed: {exc}"[:500])
            self.channel.send(topics.site_status_topic(self.config.run_id, self.config.site_id), status)
        self.done.add(key)

    def _train(self, task: m.TrainTask, model: m.GlobalModel) -> None:
        c = self.config
        topic = topics.site_update_topic(c.run_id, c.site_id)
        stored = self.store.load("update", task.round, task.model_hash)
        if stored is not None:  # trained before a restart: re-send, never train twice
            log.info("round %d: re-publishing the stored update", task.round)
            self.channel.transport.publish(topic, stored)
            return
        self.channel.send(topics.site_status_topic(c.run_id, c.site_id), self._status("training", f"round {task.round}"))
        result = self.trainer.train(model.model, _writable(model), task.settings, task.round)
        update = m.ClientUpdate(
            run_id=c.run_id, sender=c.site_id, round=task.round, base_model_hash=task.model_hash,
            tensors=arrays_to_blobs(result.weights), n_samples=result.n_samples, local_steps=result.steps,
            train_loss=result.train_loss, val_metrics=result.val_metrics, undefined=result.undefined,
            compute_seconds=result.seconds, label_histogram=self.data.label_histogram() if c.share_label_histogram else None,
        )
        payload = encode(update, max_bytes=self.channel.max_bytes)
        self.store.save("update", task.round, task.model_hash, payload)  # durable before it leaves
        self.channel.transport.publish(topic, payload)
        log.info("round %d: trained %d steps in %.2f s, val auroc %s", task.round, result.steps, result.seconds,
                 result.val_metrics.get("auroc"))

    def _evaluate(self, task: m.EvalTask, model: m.GlobalModel) -> None:
        c = self.config
        metrics, counts, undefined = self.trainer.evaluate(model.model, _writable(model), task.splits)
        report = m.EvalReport(run_id=c.run_id, sender=c.site_id, round=task.round, model_hash=task.model_hash,
                              tag=task.tag, metrics=metrics, n_samples=counts, undefined=undefined)
        self.channel.send(topics.site_report_topic(c.run_id, c.site_id), report)
        self.channel.send(topics.site_status_topic(c.run_id, c.site_id), self._status("online", "final model evaluated"))
        log.info("evaluated model %s: test %s", task.model_hash[:8], metrics.get("test"))


def _writable(model: m.GlobalModel) -> dict:
    return {k: v.copy() for k, v in blobs_to_arrays(model.tensors).items()}


__all__ = ["SiteAgent"]
