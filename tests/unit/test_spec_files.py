"""Specs given by path: a table's feature spec, a site's whole data spec, in simulation and site configs.

Relative paths are resolved against the file that names them, and a missing or invalid file is one clear
error naming it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedmqtt.data.registry import load_site_data
from fedmqtt.data.spec import DataSpec, load_data_spec, load_partition_spec
from fedmqtt.errors import ConfigError
from fedmqtt.simulation_config import load_simulation_config
from site_agent.config import load_site_config

COLUMNS = 'label = "y"\nnumeric = ["a", "b"]\ndrop = ["id"]\n'


def table(path: Path, n: int = 30) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("id,a,b,y\n" + "\n".join(f"{k},{k % 7},{(k * 3) % 5},{int(k % 3 == 0)}" for k in range(n)) + "\n")
    return path


def test_simulation_sites_and_feature_specs_by_path(tmp_path: Path) -> None:
    """`sites.a = "sites/a.toml"` and `options.spec = "cols.toml"`: each path read against its own file."""
    # Prepare: data/ holds the CSV; sites/a.toml names it and the feature spec beside it
    table(tmp_path / "data" / "a.csv")
    (tmp_path / "sites").mkdir()
    (tmp_path / "sites" / "cols.toml").write_text(COLUMNS)
    (tmp_path / "sites" / "a.toml").write_text('[data]\nformat = "table"\npath = "../data/a.csv"\n'
                                              'options = { spec = "cols.toml" }\n')
    table(tmp_path / "b.csv")
    (tmp_path / "sim.toml").write_text(
        'rounds = 1\n[sites]\na = "sites/a.toml"\n'
        'b = { format = "table", path = "b.csv", options = { spec = "sites/cols.toml" } }\n')
    # Execute
    cfg = load_simulation_config(tmp_path / "sim.toml")
    # Assert
    assert cfg.sites["a"].path.resolve() == tmp_path / "data" / "a.csv"
    assert Path(cfg.sites["a"].options["spec"]) == tmp_path / "sites" / "cols.toml"
    assert Path(cfg.sites["b"].options["spec"]) == tmp_path / "sites" / "cols.toml"
    for spec in cfg.sites.values():
        assert load_site_data(spec).feature_names == ("a", "b")


def test_missing_or_invalid_spec_files_name_the_file(tmp_path: Path) -> None:
    table(tmp_path / "a.csv")
    (tmp_path / "sim.toml").write_text(
        '[sites]\na = { format = "table", path = "a.csv", options = { spec = "no.toml" } }\n')
    with pytest.raises(ConfigError, match=r"site 'a': .*no\.toml: FeatureSpec file not found"):
        load_simulation_config(tmp_path / "sim.toml")
    (tmp_path / "sim.toml").write_text('[sites]\na = "nowhere.toml"\n')
    with pytest.raises(ConfigError, match=r"nowhere\.toml: DataSpec file not found"):
        load_simulation_config(tmp_path / "sim.toml")
    (tmp_path / "sim.toml").write_text('[sites]\na = "stroke"\n')
    with pytest.raises(ConfigError, match="neither a data-spec table nor the path"):
        load_simulation_config(tmp_path / "sim.toml")
    (tmp_path / "bad.toml").write_text('format = "table"\npath = "a.csv"\ncolour = 1\n')
    with pytest.raises(ConfigError, match=r"bad\.toml: invalid DataSpec: colour"):
        load_data_spec(tmp_path / "bad.toml")
    (tmp_path / "p.json").write_text('{"kind": "label_skew", "n_sites": 3}')
    with pytest.raises(ConfigError, match=r"p\.json: invalid PartitionSpec: .*needs alpha"):
        load_partition_spec(tmp_path / "p.json")
    with pytest.raises(ValueError, match="unknown feature spec 'diabetes'"):
        DataSpec(format="table", path=tmp_path / "a.csv", options={"spec": "diabetes"})


def test_a_site_config_reads_its_feature_spec_file_beside_it(tmp_path: Path) -> None:
    """A deployed site: the feature-spec path in its config is read against the config's folder."""
    site = tmp_path / "hospital"
    table(site / "a.csv")
    (site / "cols.toml").write_text(COLUMNS)
    (site / "site.toml").write_text('site_id = "a"\nrun_id = "r"\ncredentials = "a.toml"\nstate_dir = "state"\n'
                                    '[data]\nformat = "table"\npath = "a.csv"\noptions = { spec = "cols.toml" }\n')
    cfg = load_site_config(site / "site.toml")
    assert load_site_data(cfg.data).feature_names == ("a", "b")
