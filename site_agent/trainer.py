"""Turn tasks into payload contents with fedmqtt.training (torch lives here and in fedmqtt.training)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedmqtt.startup import imports_without_gc

# torch is most of a site process's imports (about 1 CPU s): without the collector's passes over what it makes
with imports_without_gc():
    import numpy as np
    import torch

    from fedmqtt.data.splits import SiteData
    from fedmqtt.training.client_rules import finish_round, plan_terms
    from fedmqtt.training.evaluate import evaluate_split
    from fedmqtt.training.loop import derive_seed, train_local
    from fedmqtt.training.models import build_model, model_manifest
    from fedmqtt.training.privacy import (
        HistoryEntry,
        RoundPlan,
        labelled_rows,
        model_problem,
        plan_round,
        settings_problem,
        train_local_dp,
    )
    from fedmqtt.training.statistics import site_statistics
    from fedmqtt.training.targets import init_output_bias
    from fedmqtt.training.usage import UsageMeter, pick_amp
    from fedmqtt.training.weights import load_arrays, state_to_arrays
    from schemas.messages import ModelSpec, PrivacySpent, ResourceUsage, TrainSettings

Metrics = dict[str, float | None]


def use_threads(n: int) -> None:
    torch.set_num_threads(n)


def pick_device(choice: str) -> str:
    """`auto` takes CUDA when there is one (a hospital GPU), else the CPU."""
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device = 'cuda' but torch sees no CUDA device (is a CUDA build of torch installed?)")
    return choice


@dataclass(frozen=True)
class TrainResult:
    weights: dict[str, np.ndarray]  # every tensor of the model after local training
    n_samples: int
    steps: int
    train_loss: float | None
    seconds: float
    val_metrics: Metrics
    undefined: dict[str, str]
    uplink_extras: dict[str, Any]  # algorithm fields for the update (SCAFFOLD delta_c, FedNova a_norm)
    algo_state: dict[str, dict[str, np.ndarray]]  # the site's new algorithm state (pending, 0.6)
    usage: ResourceUsage | None = None
    no_step_reason: str = ""  # set when no optimiser step was possible: nothing to send but this reason
    # Record-level DP: the accountant's new history (to store before the update leaves) and what it spent.
    dp_history: list[tuple[float, float, int]] | None = None
    privacy: PrivacySpent | None = None


class Trainer:
    """Holds the site's data and one model instance, rebuilt only when the model spec changes."""

    def __init__(self, site_id: str, data: SiteData, *, device: str = "cpu", amp: str = "auto") -> None:
        self.site_id = site_id
        self.data = data
        self.device = device
        self.amp = pick_amp(amp, device)
        self._spec: ModelSpec | None = None
        # Regression targets here are lengths of stay: predictions below 0 days are clamped (Scheltjens et al.).
        self._nonnegative = data.task.kind == "regression"
        self._model: torch.nn.Module | None = None
        self._manifest: tuple[ModelSpec, dict[str, dict[str, Any]]] | None = None

    def _load(self, spec: ModelSpec, weights: dict[str, np.ndarray]) -> torch.nn.Module:
        if self._model is None or spec != self._spec:
            self._model, self._spec = build_model(spec.name, dict(spec.args)), spec
        load_arrays(self._model, weights)
        return self._model

    def manifest(self, spec: ModelSpec) -> dict[str, dict[str, Any]]:
        """The spec's tensor manifest, built once per spec: building it constructs (and randomly initialises) a
        whole model, which for a 16 MB MLP cost about 3 % of a site's time per round when done every round."""
        if self._manifest is None or self._manifest[0] != spec:
            self._manifest = (spec, model_manifest(spec.name, dict(spec.args)))
        return self._manifest[1]

    def train(self, spec: ModelSpec, weights: dict[str, np.ndarray], settings: TrainSettings, round_no: int, *,
              eval_weights: dict[str, np.ndarray] | None = None, extras: dict[str, dict[str, np.ndarray]] | None = None,
              local: dict[str, dict[str, np.ndarray]] | None = None,
              dp_history: Sequence[HistoryEntry] = ()) -> TrainResult:
        """Validate the model this site would use (docs/algorithms.md 17.1), then train with the algorithm's rule;
        with `settings.dp`, DP-SGD continuing the accountant's `dp_history`."""
        extras, local = extras or {}, local or {}
        model = self._load(spec, eval_weights if eval_weights is not None else weights)
        val, undefined = evaluate_split(model, self.data.x_val, self.data.y_val, task=self.data.task,
                                        device=self.device, nonnegative=self._nonnegative)
        if eval_weights is not None:
            load_arrays(model, weights)
        manifest = self.manifest(spec)
        terms = plan_terms(settings, manifest, extras=extras, local=local, round_no=round_no)
        if round_no == 1:  # a regression head starts at this site's mean target, not at 0 (training.targets)
            init_output_bias(model, self.data.y_train, self.data.task)
        # Taken after that initialisation: the algorithms' state (SCAFFOLD's c_i, FedDyn's s_i) reflects
        # training only; the bias reaches the federation with the weights this site sends.
        start = state_to_arrays(model)
        dp_round = None
        with UsageMeter(self.device, self.amp) as meter:
            if settings.dp is not None:
                dp_round = train_local_dp(model, self.data.x_train, self.data.y_train, settings, settings.dp,
                                          history=dp_history, device=self.device, task=self.data.task)
                stats = dp_round.stats
            else:
                stats = train_local(model, self.data.x_train, self.data.y_train, settings,
                                    seed=derive_seed(settings.seed, self.site_id, round_no), device=self.device,
                                    terms=terms, task=self.data.task, amp=self.amp)
        end = state_to_arrays(model)
        privacy = None if dp_round is None or settings.dp is None else PrivacySpent(
            epsilon=dp_round.epsilon, delta=settings.dp.delta, accountant=settings.dp.accountant,
            noise_multiplier=dp_round.plan.noise_multiplier, sample_rate=dp_round.plan.sample_rate,
            steps=sum(n for _, _, n in dp_round.history))
        dp_new = None if dp_round is None else dp_round.history
        val_undefined = {f"val.{k}": v for k, v in undefined.items()}
        if not stats.steps:  # nothing learnt, nothing to send: no algorithm state, no statistics
            return TrainResult(end, stats.n_samples, 0, None, stats.seconds, val, val_undefined, {}, {}, meter.usage,
                               no_step_reason=stats.no_step_reason, dp_history=dp_new, privacy=privacy)
        uplink, algo_state = finish_round(settings, manifest, start=start, end=end, steps=stats.steps,
                                          extras=extras, local=local)
        kind = int(settings.hyper.get("feature_stats", 0))
        if kind:
            uplink["feature_stats"] = self._statistics(kind, spec, model, extras.get("pretrained"))
        # Under record-level DP the training loss stays home: it is computed from the records without noise.
        loss = stats.mean_loss if settings.dp is None else None
        return TrainResult(end, stats.n_samples, stats.steps, loss, stats.seconds,
                           val, val_undefined, uplink, algo_state, meter.usage, dp_history=dp_new, privacy=privacy)

    def dp_plan(self, spec: ModelSpec, settings: TrainSettings, history: Sequence[HistoryEntry]
                ) -> tuple[str | None, RoundPlan | None]:
        """Before training with record-level DP: why this model or these settings cannot (with the fix), else what
        the round will spend by the accountant."""
        assert settings.dp is not None
        problem = settings_problem(settings) or model_problem(build_model(spec.name, dict(spec.args)))
        if problem:
            return problem, None
        try:
            return None, plan_round(settings.dp, self.records(), settings, history)
        except ValueError as exc:  # a target epsilon the accountant cannot reach (noise_for says which)
            return str(exc), None

    def records(self) -> int:
        """Labelled training rows: what an update is computed from."""
        return labelled_rows(self.data.y_train, self.data.task)

    def _statistics(self, kind: int, spec: ModelSpec, trained: torch.nn.Module,
                    pretrained: dict[str, np.ndarray] | None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        f = None
        if pretrained is not None:
            f = build_model(spec.name, dict(spec.args))
            load_arrays(f, pretrained)
        return site_statistics(kind, pretrained=f, trained=trained, x_train=self.data.x_train)

    def evaluate(self, spec: ModelSpec, weights: dict[str, np.ndarray], splits: tuple[str, ...]
                 ) -> tuple[dict[str, Metrics], dict[str, int], dict[str, str]]:
        model = self._load(spec, weights)
        metrics: dict[str, Metrics] = {}
        counts: dict[str, int] = {}
        undefined: dict[str, str] = {}
        for split in splits:
            x, y = getattr(self.data, f"x_{split}"), getattr(self.data, f"y_{split}")
            metrics[split], why = evaluate_split(model, x, y, task=self.data.task, device=self.device,
                                                 nonnegative=self._nonnegative)
            counts[split] = int(len(y))
            undefined.update({f"{split}.{k}": v for k, v in why.items()})
        return metrics, counts, undefined
