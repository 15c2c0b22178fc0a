"""What the machine asks -> what the PS does: checkpoints first, then messages published under stable ids."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedmqtt.atomic import write_atomic
from fedmqtt.faults import crash_point
from fedmqtt.strategies.base import Weights
from fedmqtt.transport import topics
from fedmqtt.transport.channel import Channel
from ps_daemon import effects as fx
from ps_daemon.checkpoint import CheckpointStore, Layout, drop_read_pages, open_maps, state_to_checkpoint
from ps_daemon.config import DaemonConfig
from ps_daemon.feature_gate import statistics_path
from ps_daemon.final_outputs import write_final_outputs
from ps_daemon.monitoring import DurationTally
from ps_daemon.participant_spent import spent_after
from ps_daemon.participant_terms import participant_terms
from ps_daemon.spool import UpdateSpool
from ps_daemon.state import DaemonState, RoundRecord
from ps_daemon.status import PS, StatusBoard, secure_note
from schemas import messages as m
from schemas.codec import encode
from schemas.secagg import SecAggInbox
from schemas.tensors import arrays_to_blobs

log = logging.getLogger("fedmqtt.ps")


def stable_msg_id(*parts: object) -> str:
    """Same message, same id: a resumed PS re-sends the round with the ids receivers already know. The session
    is one of the parts, so a fresh start with the same run id and seed never looks like a replay."""
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:32]


class Outbound:
    """Runs the machine's effects in order. Each takes the runner's state and gives it back: a checkpoint
    replaces the model's arrays with maps of its file. `finished` holds the final state once the run's outputs
    are written.

    `usage` and `update_bytes` (round -> site -> ...) are the accepted updates' (see `InboundEvents`); a
    round's metrics report them. `on_round` gets each round's metrics once they are published (experiment
    tracking, fedmqtt.tracking); it must not raise."""

    def __init__(self, config: DaemonConfig, channel: Channel, store: CheckpointStore, spool: UpdateSpool,
                 status: StatusBoard, *, usage: dict[int, dict[str, dict[str, Any]]],
                 update_bytes: dict[int, dict[str, int]], started_at: float,
                 on_round: Callable[[m.RoundMetrics], None] | None = None) -> None:
        self.config = config
        self.channel = channel
        self.store = store
        self.spool = spool
        self.status = status
        self.usage = usage
        self.update_bytes = update_bytes
        self.started_at = started_at
        self.on_round = on_round
        self.finished: DaemonState | None = None
        self.checkpoint_time = DurationTally()  # for the metrics endpoint
        self._model_file: tuple[Weights, Path, Layout] | None = None  # the newest checkpoint's; see _map_weights

    def run_effects(self, state: DaemonState, effects: list[fx.Effect]) -> DaemonState:
        """Run and release each effect in turn: a SaveCheckpoint holds the state it saves (the previous model
        too, as the best round's weights, until they are in their file), which must not stay alive while the
        next model is encoded and published."""
        saved = any(isinstance(e, fx.SaveCheckpoint) for e in effects)
        kinds = [type(e) for e in effects]  # not the effects: each is released once it has run
        effects.reverse()
        while effects:
            state = self._run_effect(state, effects.pop())
        if saved:
            self.spool.drop_before(state.round)
        if any(k in (fx.PublishModel, fx.SaveCheckpoint, fx.Finish) for k in kinds):
            state = self._map_weights(state)
        return state

    def _map_weights(self, state: DaemonState) -> DaemonState:
        """After a checkpoint, hold the model's large tensors as read-only maps of it; after any read of maps (a
        publish, a checkpoint, the final save), drop the pages read. Until the next aggregation only the model's
        layout is needed, and unread pages cost the PS no memory while the next updates arrive."""
        if self._model_file is not None:
            weights, path, layout = self._model_file
            self._model_file = None
            if all(state.weights.get(name) is weights.get(name) for name in layout):
                state = replace(state, weights={**state.weights, **open_maps(path, layout)})
        drop_read_pages(state.weights)
        return state

    def _msg_id(self, state: DaemonState, *parts: object) -> str:
        """Stable per (run, session, re-publish attempt, what): see `stable_msg_id`."""
        again = ("attempt", state.attempt) if state.attempt else ()
        return stable_msg_id(self.config.run_id, state.session, *again, *parts)

    def _run_effect(self, state: DaemonState, effect: fx.Effect) -> DaemonState:
        c, ch = self.config, self.channel
        if isinstance(effect, fx.SaveCheckpoint):
            with self.checkpoint_time.measure():
                spilled = self.store.spill_best(effect.state)
                if state.best is effect.state.best:  # keep only the file's name in memory from now on
                    state = replace(state, best=spilled.best)
                path, layout = self.store.save_and_map(state_to_checkpoint(spilled, run_id=c.run_id,
                                                                           config_hash=c.config_hash()))
            self._model_file = (spilled.weights, path, layout)
            crash_point("after_checkpoint", effect.state.round - 1)
        elif isinstance(effect, fx.PublishModel):
            ch.send(topics.ps_model_topic(c.run_id), m.GlobalModel(
                run_id=c.run_id, sender=PS, round=effect.round, model=c.model, model_hash=effect.model_hash,
                tensors=arrays_to_blobs(effect.weights),
                extras={k: arrays_to_blobs(v) for k, v in effect.extras.items()},
                session=state.session, msg_id=self._msg_id(state, "model", effect.round, effect.model_hash)))
        elif isinstance(effect, fx.PublishTrainTask):
            hyper = {**c.train.hyper, **c.hyper, **effect.hyper}  # train.hyper: local optimiser keys (momentum)
            settings = c.train.model_copy(update={"algorithm": c.algorithm, "seed": c.seed, "hyper": hyper,
                                                  "dp": c.record_dp()})
            ch.send(topics.ps_task_topic(c.run_id, effect.site_id), m.TrainTask(
                run_id=c.run_id, sender=PS, round=effect.round, site_id=effect.site_id,
                model_hash=effect.model_hash, deadline=effect.deadline, settings=settings,
                accepted_round=effect.accepted_round, tensors=arrays_to_blobs(effect.tensors),
                upload=effect.upload, best_round=effect.best_round, session=state.session,
                secure_aggregation=effect.secure, participant_dp=participant_terms(c),
                per_label_tensors=effect.per_label,
                msg_id=self._msg_id(state, "train", effect.round, effect.site_id, effect.model_hash,
                                    *((effect.secure.attempt,) if effect.secure is not None else ()))))
        elif isinstance(effect, fx.PublishSecAgg):
            if isinstance(effect.message, SecAggInbox):  # the shares are in, no masked input yet
                crash_point("ps_before_inbox", effect.message.round)
            ch.send(topics.ps_task_topic(c.run_id, effect.site_id), effect.message)
        elif isinstance(effect, fx.PublishFeatureStatistics):
            path = statistics_path(c)
            if not path.is_file():  # kept first: a PS stopped after publishing them never asks the sites again
                write_atomic(path, encode(effect.message))
            ch.send(topics.ps_features_topic(c.run_id), effect.message)
        elif isinstance(effect, fx.PublishEvalTask):
            ch.send(topics.ps_task_topic(c.run_id, effect.site_id), m.EvalTask(
                run_id=c.run_id, sender=PS, round=effect.round, site_id=effect.site_id,
                model_hash=effect.model_hash, accepted_round=effect.accepted_round,
                tensors=arrays_to_blobs(effect.tensors), best_round=effect.best_round, session=state.session,
                tag=effect.tag, splits=effect.splits,
                msg_id=self._msg_id(state, "eval" if effect.tag == "final" else f"eval-{effect.tag}", effect.round,
                                    effect.site_id, effect.model_hash)))
        elif isinstance(effect, fx.PublishRecruitment):
            ch.send(topics.ps_task_topic(c.run_id, effect.site_id), m.RecruitmentResult(
                run_id=c.run_id, sender=PS, round=0, site_id=effect.site_id, recruited=effect.recruited,
                score=effect.score, rank=effect.rank, candidates=effect.candidates, detail=effect.detail,
                session=state.session, msg_id=self._msg_id(state, "recruit", effect.site_id)))
        elif isinstance(effect, fx.PublishStatus):
            self.status.publish(self.status.message(
                effect.state, effect.round, session=state.session, waiting_for=effect.waiting_for,
                deadline=effect.deadline, detail=effect.detail, sites_online=tuple(sorted(state.online)),
                dropped=dict(effect.dropped), secure_last_round=secure_note(state.history[-1] if state.history
                                                                           else None),
                participant_dp=effect.participant_dp))
        elif isinstance(effect, fx.PublishRoundMetrics):
            metrics = self._round_metrics(effect.record)
            ch.send(topics.ps_metrics_topic(c.run_id), metrics)
            if self.on_round is not None:
                self.on_round(metrics)
        elif isinstance(effect, fx.Log):
            (log.warning if effect.level == "warning" else log.info)(effect.text)
        elif isinstance(effect, fx.Finish):
            write_final_outputs(c, ch, effect.state, started_at=self.started_at, usage=self.usage,
                                privacy={s: p.model_dump() for s, p in self.status.epsilon.items()})
            self.finished = effect.state
        return state

    def _round_metrics(self, r: RoundRecord) -> m.RoundMetrics:
        log.info("round %d closed: sites %s, mean val auroc %s", r.round, ",".join(r.sites), r.mean.get("auroc"))
        return m.RoundMetrics(
            run_id=self.config.run_id, sender=PS, round=r.round, sites=r.sites, stragglers=r.stragglers,
            per_site={s: dict(metrics) for s, metrics in r.per_site.items()}, mean=dict(r.mean),
            train_loss=r.train_loss, duration_s=r.closed_at - r.started_at,
            usage={s: m.ResourceUsage(**u) for s, u in self.usage.get(r.round, {}).items() if s in r.sites},
            update_bytes={s: n for s, n in self.update_bytes.pop(r.round, {}).items() if s in r.sites},
            secure=secure_note(r), participant_dp=spent_after(r))
