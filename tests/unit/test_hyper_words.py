"""A rule's choice given as a word in `hyper` (FedFBN's partial_labels) reaches the rule from a TOML config, a grid
and `--hyper`; a word where a number belongs is refused with the name of the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from pydantic import ValidationError

from fedmqtt.cli.simulate import _parse_hyper
from fedmqtt.errors import ConfigError
from fedmqtt.simulation_config import SimulationConfig, load_simulation_config
from fedmqtt.strategies import build_strategy


def _rule_params(cfg: SimulationConfig) -> object:
    daemon = cfg.daemon_config()
    return build_strategy(daemon.algorithm, daemon.strategy_params()).params  # type: ignore[attr-defined]


def test_partial_labels_word_reaches_fedfbn_from_a_toml_config(tmp_path: Path) -> None:
    path = tmp_path / "sim.toml"
    path.write_text('algorithm = "fedfbn"\nrounds = 1\n[hyper]\npartial_labels = "masked_loss"\n', encoding="utf-8")
    cfg = load_simulation_config(path)
    assert cfg.hyper == {"partial_labels": "masked_loss"}
    assert _rule_params(cfg).partial_labels == "masked_loss"  # type: ignore[attr-defined]
    default = SimulationConfig(algorithm="fedfbn", rounds=1)
    assert _rule_params(default).partial_labels == "surgical"  # type: ignore[attr-defined]


def test_a_word_the_rule_does_not_offer_is_refused_by_name() -> None:
    with pytest.raises((ConfigError, ValidationError), match="partial_labels"):
        SimulationConfig(algorithm="fedfbn", rounds=1, hyper={"partial_labels": "sometimes"}).daemon_config()
    with pytest.raises((ConfigError, ValidationError), match="mu"):
        SimulationConfig(algorithm="fedprox", rounds=1, hyper={"mu": "large"}).daemon_config()


def test_a_word_for_a_local_optimiser_key_is_refused() -> None:
    with pytest.raises((ConfigError, ValidationError), match="momentum must be a number"):
        SimulationConfig(algorithm="fedavg", rounds=1, hyper={"momentum": "fast"}).daemon_config()


def test_numbers_stay_numbers_in_toml(tmp_path: Path) -> None:
    """A TOML number (int or float) is still a float for the rule; only a quoted word stays a word."""
    path = tmp_path / "sim.toml"
    path.write_text('algorithm = "fedprox"\nrounds = 1\n[hyper]\nmu = 1\n', encoding="utf-8")
    cfg = load_simulation_config(path)
    assert cfg.hyper == {"mu": 1.0} and isinstance(cfg.hyper["mu"], float)


def test_cli_hyper_parses_numbers_and_words() -> None:
    assert _parse_hyper(["mu=0.5", "partial_labels=masked_loss", "lam = 2"]) == {
        "mu": 0.5, "partial_labels": "masked_loss", "lam": 2.0}
    for bad in ("mu", "=1", "mu="):
        with pytest.raises(typer.BadParameter, match="NAME=VALUE"):
            _parse_hyper([bad])
