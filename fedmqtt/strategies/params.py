"""Hyper-parameters of the server rules: frozen pydantic models, errors naming algorithm and field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedmqtt.errors import ConfigError

P = TypeVar("P", bound="StrategyParams")

# A hyper-parameter in a config: a number, or a word where the rule offers a choice (FedFBN's partial_labels);
# each rule's Params model says which it takes and refuses the other.
HyperValue = float | str
Weighting = Literal["samples", "uniform"]
NormFamily = Literal["batchnorm", "groupnorm", "layernorm", "instancenorm"]
ALL_NORMS: tuple[NormFamily, ...] = ("batchnorm", "groupnorm", "layernorm", "instancenorm")


class StrategyParams(BaseModel):
    """Base of every `Params` model: frozen, unknown keys refused, every field has a default."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class NoParams(StrategyParams):
    """For rules without hyper-parameters."""


class WeightingParams(StrategyParams):
    """Sample weights p_i = n_i / n_S by default; `uniform` gives 1/|S_t| (the original papers' choice)."""

    weighting: Weighting = Field(
        default="samples", description="participant weights: samples (p_i = n_i/n_S) or uniform (1/|S_t|)"
    )


def expand_norm_types(value: object) -> object:
    """Validator for `norm_types`: "all" (or ["all"]) means every family; a bare string is one family."""
    if value == "all" or (isinstance(value, (list, tuple)) and list(value) == ["all"]):
        return ALL_NORMS
    return (value,) if isinstance(value, str) else value


def mu_field(default: float = 0.01) -> Any:
    """The proximal coefficient shared by FedProx and FedPxN (docs/algorithms.md 2 and 4)."""
    return Field(default=default, ge=0.0, description="proximal coefficient mu (squared-norm term), >= 0")


# Settings of the SITE's local optimiser that may be given with an algorithm's hyper-parameters (e.g.
# FedNova's paper setting: `--hyper momentum=0.9`). No server rule reads them: they travel in the task's
# `hyper` to the site, whose optimiser uses them (fedmqtt.training.loop) and whose FedNova ||a_i||_1
# follows them (fedmqtt.training.client_rules), so the two can never disagree.
LOCAL_OPTIMISER_KEYS = {
    "momentum": "local SGD momentum factor in [0, 1) (heavy ball, PyTorch form); needs optimizer sgd",
    "nesterov": "1: Nesterov momentum (needs momentum > 0 and optimizer sgd); 0: off",
    "balance_classes": "1: class weights from the site's own training labels in the loss (imbalanced "
                       "labels); 0: off",
}


def check_local_optimiser(hyper: Mapping[str, Any], optimizer: str) -> None:
    """Raise ConfigError when the local optimiser keys of `hyper` are out of range or do not fit
    `optimizer`."""
    for key in LOCAL_OPTIMISER_KEYS:
        if isinstance(hyper.get(key, 0.0), str):
            raise ConfigError(f"{key} must be a number (got {hyper[key]!r})")
    momentum = hyper.get("momentum", 0.0)
    nesterov = hyper.get("nesterov", 0.0)
    if not 0.0 <= float(momentum) < 1.0:
        raise ConfigError(f"momentum must be in [0, 1) (got {momentum!r})")
    for flag in ("nesterov", "balance_classes"):
        if float(hyper.get(flag, 0.0)) not in (0.0, 1.0):
            raise ConfigError(f"{flag} must be 0 or 1 (got {hyper[flag]!r})")
    if float(nesterov) and not float(momentum):
        raise ConfigError("nesterov = 1 needs momentum > 0 (e.g. --hyper momentum=0.9)")
    if (float(momentum) or float(nesterov)) and optimizer != "sgd":
        raise ConfigError(f"momentum/nesterov are settings of SGD, but train.optimizer is {optimizer!r}: set "
                          "train.optimizer = \"sgd\" (--optimizer sgd) or drop them")


def parse_params(algorithm: str, model: type[P], raw: Mapping[str, Any] | None) -> P:
    """Validate `raw` against `model`, or raise ConfigError naming the algorithm and every bad field.

    Args:
        algorithm: registry name used as the message prefix, e.g. "fedprox".
        model: the rule's `Params` class.
        raw: user-supplied values (None or empty: all defaults).

    Returns:
        The frozen, validated parameters.

    Raises:
        ConfigError: e.g. "fedprox: mu must be greater than or equal to 0 (got -1)".
    """
    raw = dict(raw or {})
    local = {k: raw.pop(k) for k in LOCAL_OPTIMISER_KEYS if k in raw and k not in model.model_fields}
    try:
        check_local_optimiser(local, "sgd")  # ranges here; the optimiser is checked with the train settings
    except ConfigError as exc:
        raise ConfigError(f"{algorithm}: {exc}") from None
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        known = ", ".join(model.model_fields) or "none"
        problems = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "(params)"
            if err["type"] == "extra_forbidden":
                problems.append(f"unknown parameter {field!r} (known: {known}; local optimiser: "
                                f"{', '.join(LOCAL_OPTIMISER_KEYS)})")
                continue
            msg = str(err["msg"]).replace("Input should be", "must be").replace("Value error, ", "")
            problems.append(f"{field} {msg} (got {err.get('input')!r})")
        raise ConfigError(f"{algorithm}: " + "; ".join(problems)) from None
