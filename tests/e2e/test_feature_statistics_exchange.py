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
from harness import FAST_TRAIN
from safetensors.numpy import load_file

from fedmqtt.config_io import dump_toml, read_toml
from fedmqtt.data.feature_stats import Grid, Summary
from fedmqtt.data.feature_wire import read_statistics_message, summary_message
from fedmqtt.data.registry import site_train_summary
from fedmqtt.federation_stats import federation_statistics
from fedmqtt.simulation import SimulationConfig, bundled_sites, run_simulation
from fedmqtt.transport import topics
from schemas import messages as m
from schemas.codec import encode, pack
from site_agent.config import SiteConfig, load_site_config

pytestmark = pytest.mark.e2e
RUN = "e2e-fstats"


def _hostile_summaries(site: str, config: SiteConfig) -> list[tuple[str, bytes]]:
    """Summaries a party with the site's credentials can sign: valid ones of other columns, and broken sums."""
    item = site_train_summary(config.data)
    real = summary_message(item.summary, item.grid, item.columns, run_id=RUN, sender=site)
    fewer = summary_message(
        Summary(item.summary.entries, item.summary.count[:2], item.summary.total[:2], item.summary.total_sq[:2],
                item.summary.histogram[:2]),
        Grid(item.grid.low[:2], item.grid.high[:2], item.grid.scale[:2], item.grid.bins), item.columns[:2],
        run_id=RUN, sender=site)
    shifted = dict(real.model_dump(mode="python"), total=[real.count[0] * (real.high[0] + 1), *real.total[1:]])
    return [("other columns", encode(fewer)), ("a sum its histogram contradicts", pack(shifted))]


def test_sites_send_summaries_and_all_standardise_with_the_same_statistics(cli_federation, paho_client,
                                                                           tmp_path: Path) -> None:
    # Prepare
    fed = cli_federation("fstats", run_id=RUN, rounds=1, sites=("cleveland", "hungary"),
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
    # A party with hungary's credentials sends summaries that do not fit (signed: signing does not make content
    # valid): each is refused and counted in ps/status, and the PS keeps waiting
    fed.kill("hungary")
    mallory, me = paho_client(fed.layout.settings("hungary")), fed.layout.identity("hungary")
    features = topics.site_features_topic(RUN, "hungary")
    for _what, payload in _hostile_summaries("hungary", load_site_config(fed.site_configs["hungary"])):
        mallory.publish(features, me.seal(features, payload), qos=2, retain=True).wait_for_publish(10)
    counted = fed.wait_message(lambda msg: isinstance(msg, m.DaemonStatus)
                               and sum(msg.rejected.get("hungary", {}).values()) >= 2, 60, "the refusals counted")
    assert isinstance(counted, m.DaemonStatus) and counted.state == "waiting_for_sites"
    assert "feature summary refused" in counted.rejected["hungary"]
    mallory.disconnect()
    fed.check_alive()
    # hungary's hospital switches to federated statistics and restarts (its summary replaces the retained one):
    # the run goes through
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
    want = read_statistics_message(federation_statistics(RUN, summaries, tmp_path / "sim"))
    for field in ("low", "high", "fill", "mean", "std"):
        np.testing.assert_array_equal(np.array(getattr(got, field), dtype=float),
                                      np.array(getattr(want, field), dtype=float), err_msg=field)
    assert "feature statistics combined from 2 sites (cleveland, hungary)" in fed.tail("ps", 400)
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert [r["sites"] for r in report["rounds"]] == [["cleveland", "hungary"]]


def test_a_resumed_ps_uses_the_kept_statistics_and_does_not_ask_again(cli_federation) -> None:
    # Prepare: the PS SIGKILLs itself right after round 1's checkpoint
    fed = cli_federation("fstats-resume", run_id=RUN, rounds=2, sites=("cleveland", "hungary"),
                         ps_extra={"quorum": 2, "feature_statistics": "federated"})
    for site in fed.sites:
        config = read_toml(fed.site_configs[site])
        config["feature_statistics"] = "federated"
        fed.site_configs[site].write_text(dump_toml(config))
    fed.start_broker()
    fed.start_ps(fault="after_checkpoint:1")
    for site in fed.sites:
        fed.start_site(site)
    fed.procs["ps"].wait(180)
    kept = (fed.work / "ps" / "feature_statistics.msgpack").read_bytes()
    # Execute: --resume, with the sites' summaries still retained at the broker (replayed to the new PS)
    fed.start_ps(resume=True)
    fed.wait_ps_done(180)
    # Assert: combined once, read back on resume, the replayed summaries neither combined nor counted as refusals
    log = fed.tail("ps", 1000)
    assert log.count("feature statistics combined from 2 sites") == 1
    assert "--resume: the federation's feature statistics of sites cleveland, hungary" in log
    assert "feature summary:" not in log
    assert (fed.work / "ps" / "feature_statistics.msgpack").read_bytes() == kept
    for site in fed.sites:
        state_dir = load_site_config(fed.site_configs[site]).state_dir
        assert (state_dir / "feature_statistics.msgpack").read_bytes() == kept
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert [r["round"] for r in report["rounds"]] == [1, 2]


def test_over_mqtt_equals_the_simulation_with_federated_statistics(cli_federation, tmp_path: Path) -> None:
    """The same config and seed, feature_statistics = "federated" on both sides: bit-identical final weights and
    the same site metrics (the statistics travel as messages here, in process in the simulation)."""
    # Prepare
    sites, run_id = ("cleveland", "switzerland"), "eq-fstats"
    model = {"name": "mlp", "args": {"in_features": 15, "hidden": [16], "norm": "bn"}}
    fed = cli_federation("fstats-eq", run_id=run_id, rounds=2, sites=sites, train=FAST_TRAIN, model=model,
                         ps_extra={"feature_statistics": "federated"})
    for site in sites:
        config = read_toml(fed.site_configs[site])
        config["feature_statistics"] = "federated"
        fed.site_configs[site].write_text(dump_toml(config))
    sim = SimulationConfig(run_id=run_id, rounds=2, seed=0, out_dir=tmp_path / "sim", model=model, train=FAST_TRAIN,
                           feature_statistics="federated",
                           sites={s: d for s, d in bundled_sites().items() if s in sites})
    # Execute
    fed.run_to_completion(240)
    sim_report = run_simulation(sim, progress=False)
    # Assert
    over_mqtt = load_file(str(fed.work / "ps" / "final_model.safetensors"))
    simulated = load_file(str(tmp_path / "sim" / "final_model.safetensors"))
    assert sorted(over_mqtt) == sorted(simulated)
    for name in over_mqtt:
        np.testing.assert_array_equal(over_mqtt[name], simulated[name], err_msg=name)
    mqtt_report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert mqtt_report["final"]["per_site"] == sim_report["final"]["per_site"]
    sim_stats = read_statistics_message(tmp_path / "sim" / "feature_statistics.json")
    got = read_statistics_message(fed.work / "ps" / "feature_statistics.msgpack")
    same = {"msg_id", "sent_at", "session"}  # one message each, of its own run start
    assert got.model_dump(exclude=same) == sim_stats.model_dump(exclude=same)
