"""Federated feature statistics over a real broker and real processes: with feature_statistics = "federated" in
the PS's and the sites' configs, each site sends its feature summary before round 1, the PS combines them,
publishes the federation's statistics on ps/features and keeps them, and every site stores the same statistics
(0600 in its state_dir) and trains on data standardised with them. The statistics equal the simulation's
combination of the same sites' training splits (fedmqtt.federation_stats)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import numpy as np
import pytest

from fedmqtt.config_io import dump_toml, read_toml
from fedmqtt.data.feature_wire import read_statistics_message
from fedmqtt.data.registry import site_train_summary
from fedmqtt.federation_stats import federation_statistics
from schemas import messages as m
from site_agent.config import load_site_config

pytestmark = pytest.mark.e2e


def test_sites_send_summaries_and_all_standardise_with_the_same_statistics(cli_federation, tmp_path: Path) -> None:
    # Prepare
    fed = cli_federation("fstats", run_id="e2e-fstats", rounds=1, sites=("cleveland", "hungary"),
                         ps_extra={"quorum": 2, "feature_statistics": "federated"})
    config = read_toml(fed.site_configs["cleveland"])
    config["feature_statistics"] = "federated"
    fed.site_configs["cleveland"].write_text(dump_toml(config))
    fed.start_broker()
    fed.watch()
    fed.start_ps()
    for site in fed.sites:
        fed.start_site(site)
    # Execute: hungary's config still says "site": it sends no summary, and the PS waits, naming it
    waiting = fed.wait_message(lambda msg: isinstance(msg, m.DaemonStatus) and "feature summaries" in msg.detail,
                               90, "ps/status waiting for feature summaries")
    assert isinstance(waiting, m.DaemonStatus) and waiting.state == "waiting_for_sites"
    assert waiting.detail == "waiting for feature summaries from sites hungary"
    # hungary's hospital switches to federated statistics and restarts: the run goes through
    fed.kill("hungary")
    config = read_toml(fed.site_configs["hungary"])
    config["feature_statistics"] = "federated"
    fed.site_configs["hungary"].write_text(dump_toml(config))
    fed.start_site("hungary")
    fed.wait_ps_done(240)
    # Assert: one statistics file content at the PS and at every site, private, and the simulation's numbers
    kept = (fed.work / "ps" / "feature_statistics.msgpack").read_bytes()
    configs = {site: load_site_config(fed.site_configs[site]) for site in fed.sites}
    for site, config in configs.items():
        path = config.state_dir / "feature_statistics.msgpack"
        assert path.read_bytes() == kept, site
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert "standardising with the federation's feature statistics" in fed.tail(site, 400)
    got = read_statistics_message(fed.work / "ps" / "feature_statistics.msgpack")
    assert got.sites == ("cleveland", "hungary")
    summaries = {site: site_train_summary(config.data) for site, config in sorted(configs.items())}
    want = read_statistics_message(federation_statistics("e2e-fstats", summaries, tmp_path / "sim"))
    for field in ("low", "high", "fill", "mean", "std"):
        np.testing.assert_array_equal(np.array(getattr(got, field), dtype=float),
                                      np.array(getattr(want, field), dtype=float), err_msg=field)
    assert "feature statistics combined from 2 sites (cleveland, hungary)" in fed.tail("ps", 400)
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert [r["sites"] for r in report["rounds"]] == [["cleveland", "hungary"]]
