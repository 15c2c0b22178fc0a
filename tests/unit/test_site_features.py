"""A site's side of the federation's feature statistics (site_agent/federation_features.py): the statistics it
keeps are for its run, its columns and include its own summary; they are stored atomically and 0600, survive a
restart, and a damaged file is dropped (asked for again), never used."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from fedmqtt.data.feature_wire import combine_messages
from fedmqtt.data.heart_disease import bundled_path
from site_agent.config import SiteConfig
from site_agent.federation_features import SiteFeatures


def _config(tmp_path: Path, site: str = "cleveland", mode: str = "federated") -> SiteConfig:
    return SiteConfig.model_validate({
        "site_id": site, "run_id": "r1", "credentials": tmp_path / "creds.toml", "state_dir": tmp_path / site,
        "data": {"format": "heart_disease", "path": str(bundled_path(site))}, "feature_statistics": mode})


def test_statistics_are_checked_kept_private_and_read_again(tmp_path: Path) -> None:
    configs = {s: _config(tmp_path, s) for s in ("cleveland", "hungary")}
    for c in configs.values():
        c.state_dir.mkdir(mode=0o700)
    features = SiteFeatures(configs["cleveland"])
    summary = features.summary()
    assert features.waiting and features.spec() == configs["cleveland"].data
    stats = combine_messages([summary, SiteFeatures(configs["hungary"]).summary()], run_id="r1")
    columns = tuple(summary.columns)
    assert features.refusal(stats.model_copy(update={"run_id": "r2"}), columns) == "statistics of run 'r2'"
    assert "not in them" in (features.refusal(stats.model_copy(update={"sites": ("hungary",)}), columns) or "")
    assert "other columns" in (features.refusal(stats, columns[:-1]) or "")
    assert features.refusal(stats, columns) is None
    assert features.keep(stats) and not features.keep(stats)  # the same ones again: nothing to do
    assert stat.S_IMODE(features.path.stat().st_mode) == 0o600
    assert not features.waiting and features.spec().statistics == features.path
    again = SiteFeatures(configs["cleveland"])  # a restarted agent
    assert again.held is not None and again.held.model_dump() == stats.model_dump() and not again.waiting


@pytest.mark.parametrize("content", [b"", b"\x00" * 64, b'{"kind": "site_status"}'])
def test_a_damaged_statistics_file_is_dropped_not_used(tmp_path: Path, content: bytes) -> None:
    config = _config(tmp_path)
    config.state_dir.mkdir()
    (config.state_dir / "feature_statistics.msgpack").write_bytes(content)
    features = SiteFeatures(config)
    assert features.waiting and not features.path.exists()


def test_a_site_statistics_site_refuses_the_federations(tmp_path: Path) -> None:
    config = _config(tmp_path, mode="site")
    features = SiteFeatures(config)
    stats = combine_messages([SiteFeatures(_config(tmp_path)).summary()], run_id="r1")
    assert not features.waiting and "own statistics" in (features.refusal(stats, tuple(stats.columns)) or "")
