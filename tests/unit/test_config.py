"""PS and site TOML configs: loading, path resolution, errors that name the field, the resume hash."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fedmqtt.config_io import dump_toml
from fedmqtt.errors import ConfigError
from ps_daemon.config import (
    DaemonConfig,
    SecureAggregationConfig,
    load_daemon_config,
    secure_aggregation_problem,
)
from site_agent.config import load_site_config

DAEMON_TOML = """\
run_id = "r1"
algorithm = "fedavg"
rounds = 3
sites = ["site-b", "site-a"]
quorum = 2
round_timeout_s = 60.0
seed = 7
out_dir = "runs/ps"
credentials = "secrets/ps.toml"

[model]
name = "mlp"

[model.args]
hidden = [16, 8]
norm = "bn"

[train]
epochs = 2
lr = 0.01
optimizer = "sgd"
"""

SITE_TOML = """\
site_id = "site-a"
run_id = "r1"
credentials = "site-a.toml"
state_dir = "state"
threads = 2

[data]
path = "data/cleveland.data"
split_seed = 3
fractions = [0.7, 0.15, 0.15]
"""


def _daemon_dict(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "run_id": "r1",
        "rounds": 3,
        "sites": ["site-a", "site-b"],
        "quorum": 1,
        "credentials": "ps.toml",
        "model": {"name": "mlp"},
        "train": {"epochs": 1},
    }
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    return data


def _site_dict(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "site_id": "site-a",
        "run_id": "r1",
        "credentials": "c.toml",
        "state_dir": "state",
        "data": {"path": "site.data"},
    }
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    return data


def _write(folder: Path, text: str, name: str = "config.toml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


# -- PS config -----------------------------------------------------------------------------------------
def test_daemon_config_loads_and_resolves_paths_against_its_folder(tmp_path: Path) -> None:
    """A valid file loads; relative out_dir and credentials are resolved against the file's folder."""
    # Prepare
    path = _write(tmp_path / "conf", DAEMON_TOML)
    # Execute
    cfg = load_daemon_config(path)
    # Assert
    folder = (tmp_path / "conf").resolve()
    assert cfg.out_dir == folder / "runs" / "ps"
    assert cfg.credentials == folder / "secrets" / "ps.toml"
    assert cfg.run_id == "r1" and cfg.rounds == 3 and cfg.quorum == 2 and cfg.seed == 7
    assert cfg.sorted_sites == ("site-a", "site-b") and cfg.start_sites == 2
    assert cfg.model.name == "mlp" and cfg.model.args == {"hidden": [16, 8], "norm": "bn"}
    assert (cfg.train.epochs, cfg.train.lr, cfg.train.optimizer) == (2, 0.01, "sgd")


def test_daemon_config_keeps_absolute_paths(tmp_path: Path) -> None:
    """Absolute paths are left as written."""
    out = tmp_path / "elsewhere"
    creds = tmp_path / "creds.toml"
    path = _write(tmp_path / "conf", dump_toml(_daemon_dict(out_dir=str(out), credentials=str(creds))))
    cfg = load_daemon_config(path)
    assert cfg.out_dir == out and cfg.credentials == creds


DAEMON_ERRORS = [
    pytest.param(_daemon_dict(algorithm="fedsgd"), "algorithm 'fedsgd' unknown", id="unknown-algorithm"),
    pytest.param(
        _daemon_dict(rounds=-1), "rounds: Input should be greater than or equal to 1", id="negative-rounds"
    ),
    pytest.param(_daemon_dict(rounds=0), "rounds:", id="zero-rounds"),
    pytest.param(_daemon_dict(quorum=3), "quorum 3 > number of sites 2", id="quorum-over-sites"),
    pytest.param(_daemon_dict(min_sites=5), "min_sites 5 > number of sites 2", id="min-sites-over-sites"),
    pytest.param(_daemon_dict(sites=["site-a", "site-a"]), "sites: duplicate site id", id="duplicate-sites"),
    pytest.param(_daemon_dict(sites=["site-a", "Site_B"]), "site id 'Site_B'", id="bad-site-id"),
    pytest.param(_daemon_dict(sites=[]), "sites:", id="no-sites"),
    pytest.param(_daemon_dict(run_id="R1"), "run_id: String should match pattern", id="bad-run-id"),
    pytest.param(_daemon_dict(roundz=3), "roundz: Extra inputs are not permitted", id="unknown-key"),
    pytest.param(
        _daemon_dict(train={"epoch": 2}),
        "train.epoch: Extra inputs are not permitted",
        id="unknown-nested-key",
    ),
    pytest.param(_daemon_dict(run_id=None), "run_id: Field required", id="missing-run-id"),
    pytest.param(_daemon_dict(model=None), "model: Field required", id="missing-model"),
    pytest.param(_daemon_dict(credentials=None), "credentials: Field required", id="missing-credentials"),
    pytest.param(_daemon_dict(round_timeout_s=0), "round_timeout_s:", id="zero-timeout"),
    pytest.param(_daemon_dict(train={"optimizer": "lbfgs"}), "train.optimizer:", id="bad-optimizer"),
    pytest.param(_daemon_dict(selection="fraction", fraction=0.2, quorum=2),
                 "fewer than quorum 2: no round could close", id="fraction-below-quorum"),
    pytest.param(_daemon_dict(stall_s=-1), "stall_s:", id="negative-stall"),
    pytest.param(_daemon_dict(algorithm="fedadp", sites=["a", "b", "c"], secure_aggregation={"enabled": True}),
                 "fedadp cannot run under secure aggregation", id="secagg-rule-needs-each-update"),
    pytest.param(_daemon_dict(secure_aggregation={"enabled": True}), "at least 3 sites (got 2)",
                 id="secagg-two-sites"),
    pytest.param(_daemon_dict(sites=["a", "b", "c"], secure_aggregation={"enabled": True, "clip": 1e6}),
                 "beyond the", id="secagg-ring-too-small"),
    pytest.param(_daemon_dict(secure_aggregation={"enabled": True, "dropout": 0.5}), "secure_aggregation.dropout",
                 id="secagg-dropout-range"),
]


@pytest.mark.parametrize(("data", "needle"), DAEMON_ERRORS)
def test_daemon_config_errors_name_the_field(tmp_path: Path, data: dict[str, Any], needle: str) -> None:
    """An invalid PS config raises ConfigError naming the file and the offending field."""
    path = _write(tmp_path, dump_toml(data))
    with pytest.raises(ConfigError) as info:
        load_daemon_config(path)
    assert needle in str(info.value)
    assert str(path) in str(info.value)


def test_secure_aggregation_is_off_by_default_and_enters_the_resume_hash() -> None:
    """A config without the table runs in the clear; turning it on (or changing its ring) changes what --resume
    checks, so a run cannot switch halfway."""
    clear = DaemonConfig.model_validate(_daemon_dict(sites=["a", "b", "c"]))
    assert not clear.secure_aggregation.enabled
    assert secure_aggregation_problem("fedavg", SecureAggregationConfig(enabled=True, clip=4.0), 3) is None
    wider = clear.model_copy(update={"secure_aggregation": SecureAggregationConfig(ring_bits=64)})
    assert wider.config_hash() != clear.config_hash()
    terms = SecureAggregationConfig(enabled=True).terms(3)
    assert (terms.ring_bits, terms.fraction_bits, terms.clip, terms.max_sites) == (32, 16, 8.0, 3)


def test_secure_aggregation_accepts_the_rules_that_need_only_sums() -> None:
    """FedAvg and FedProx need only sums and are accepted; FedAdp needs each site's update and is refused."""
    on = SecureAggregationConfig(enabled=True)
    for rule in ("fedavg", "fedprox"):
        assert secure_aggregation_problem(rule, on, 4) is None
    fedadp = secure_aggregation_problem("fedadp", on, 4)
    assert fedadp is not None and "cannot run under secure aggregation" in fedadp
    for rule in ("fedfbn", "feddyn", "base"):  # from the plain mean (FedFBN's surgical rows from per-label sums)
        assert secure_aggregation_problem(rule, on, 4) is None
    assert secure_aggregation_problem("fedfbn", on, 4, {"partial_labels": "masked_loss"}) is None


def test_site_id_with_a_trailing_newline_is_refused() -> None:
    """A site id must match the id pattern as a whole: 'site-b' plus a newline is not 'site-b'."""
    with pytest.raises(ValueError, match=r"site id 'site-b\\n'"):
        DaemonConfig.model_validate(_daemon_dict(sites=["site-a", "site-b\n"]))


def test_invalid_toml_is_a_config_error(tmp_path: Path) -> None:
    """A file that is not TOML raises ConfigError saying so."""
    path = _write(tmp_path, 'run_id = "r1\nrounds = = 3\n')
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_daemon_config(path)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    """A path that does not exist raises ConfigError naming it."""
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="config file not found") as info:
        load_daemon_config(path)
    assert "nope.toml" in str(info.value)


def _hash(**changes: Any) -> str:
    return DaemonConfig.model_validate(_daemon_dict(**changes)).config_hash()


@pytest.mark.parametrize(
    "changes",
    [
        {"out_dir": "/tmp/other"},
        {"credentials": "other.toml"},
        {"round_timeout_s": 5.0},
        {"keep_checkpoints": 9},
    ],
    ids=["out_dir", "credentials", "round_timeout_s", "keep_checkpoints"],
)
def test_config_hash_ignores_deployment_settings(changes: dict[str, Any]) -> None:
    """Moving the output, swapping credentials or changing the timeout keeps the resume hash."""
    assert _hash(**changes) == _hash()


@pytest.mark.parametrize(
    "changes",
    [
        {"rounds": 4},
        {"seed": 1},
        {"sites": ["site-a", "site-c"]},
        {"train": {"epochs": 2}},
        {"model": {"name": "mlp", "args": {"hidden": [4]}}},
    ],
    ids=["rounds", "seed", "sites", "train", "model"],
)
def test_config_hash_changes_with_the_experiment(changes: dict[str, Any]) -> None:
    """Anything that changes the experiment changes the hash."""
    assert _hash(**changes) != _hash()


def test_config_hash_is_stable_across_folders(tmp_path: Path) -> None:
    """The same file loaded from two folders (different resolved paths) has the same hash."""
    first = load_daemon_config(_write(tmp_path / "one", DAEMON_TOML))
    second = load_daemon_config(_write(tmp_path / "two", DAEMON_TOML))
    assert first.out_dir != second.out_dir
    assert first.config_hash() == second.config_hash()
    assert len(first.config_hash()) == 16


# -- site config ---------------------------------------------------------------------------------------
def test_site_config_loads_and_resolves_paths_against_its_folder(tmp_path: Path) -> None:
    """A valid site file loads; credentials, state_dir and data.path resolve against the file's folder."""
    # Prepare
    path = _write(tmp_path / "site", SITE_TOML)
    # Execute
    cfg = load_site_config(path)
    # Assert
    folder = (tmp_path / "site").resolve()
    assert cfg.credentials == folder / "site-a.toml"
    assert cfg.state_dir == folder / "state"
    assert cfg.data.path == folder / "data" / "cleveland.data"
    assert (cfg.site_id, cfg.run_id, cfg.threads, cfg.device) == ("site-a", "r1", 2, "auto")
    assert cfg.data.fractions == (0.7, 0.15, 0.15) and cfg.data.split_seed == 3
    assert cfg.share_label_histogram is False


SITE_ERRORS = [
    pytest.param(_site_dict(site_id="Site_A"), "site_id: String should match pattern", id="bad-site-id"),
    pytest.param(_site_dict(site_id="-a"), "site_id:", id="leading-dash"),
    pytest.param(_site_dict(sitename="x"), "sitename: Extra inputs are not permitted", id="unknown-key"),
    pytest.param(
        _site_dict(data={"path": "d", "fraction": [0.5, 0.5]}),
        "data.fraction: Extra inputs",
        id="unknown-nested-key",
    ),
    pytest.param(_site_dict(state_dir=None), "state_dir: Field required", id="missing-state-dir"),
    pytest.param(_site_dict(data={"split_seed": 1}), "data.path: Field required", id="missing-data-path"),
    pytest.param(
        _site_dict(data={"path": "d", "fractions": [0.5, 0.5, 0.5]}),
        "must be positive and sum to 1",
        id="fractions-sum",
    ),
    pytest.param(_site_dict(data={"path": "d", "format": "csv"}), "data.format:", id="unknown-format"),
    pytest.param(_site_dict(device="tpu"), "device:", id="bad-device"),
    pytest.param(_site_dict(threads=0), "threads:", id="zero-threads"),
]


@pytest.mark.parametrize(("data", "needle"), SITE_ERRORS)
def test_site_config_errors_name_the_field(tmp_path: Path, data: dict[str, Any], needle: str) -> None:
    """An invalid site config raises ConfigError naming the offending field."""
    path = _write(tmp_path, dump_toml(data))
    with pytest.raises(ConfigError) as info:
        load_site_config(path)
    assert needle in str(info.value)


def test_site_config_invalid_toml_and_missing_file(tmp_path: Path) -> None:
    """Broken TOML and a missing file are ConfigErrors too."""
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_site_config(_write(tmp_path, "[data\npath = 1"))
    with pytest.raises(ConfigError, match="config file not found"):
        load_site_config(tmp_path / "missing.toml")
