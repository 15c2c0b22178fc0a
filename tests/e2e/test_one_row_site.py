"""A hospital with one training row, over a real broker: it answers that it cannot train, the PS takes the answer
and closes each round at once without its update. Before, its zero-step update was refused: every round waited for
its deadline (re-publishing the task every stall_s), and with a quorum it could not meet, for ever."""

from __future__ import annotations

import json

import pytest

from fedmqtt.config_io import dump_toml, read_toml
from fedmqtt.data.heart_disease import bundled_path

pytestmark = pytest.mark.e2e


def test_a_site_with_one_training_row_is_skipped_and_the_run_finishes(cli_federation) -> None:
    # Prepare: hungary keeps 3 of its rows, 1 of them for training
    fed = cli_federation("one-row", run_id="e2e-one-row", rounds=2, sites=("cleveland", "hungary"),
                         round_timeout_s=600.0)  # a round that waits for its deadline fails the test
    rows = fed.work / "hungary-3-rows.data"
    rows.write_text("\n".join(bundled_path("hungary").read_text().splitlines()[:3]) + "\n")
    path = fed.site_configs["hungary"]
    config = read_toml(path)
    config["data"] = {"format": "heart_disease", "path": str(rows), "fractions": [0.34, 0.33, 0.33]}
    path.write_text(dump_toml(config))
    # Execute
    fed.run_to_completion(180)
    # Assert
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert [r["sites"] for r in report["rounds"]] == [["cleveland"], ["cleveland"]]
    assert all("1 labelled training row" in r["skipped"]["hungary"] for r in report["rounds"])
    assert "took no training step in round 1" in fed.tail("ps", 2000)
    assert not report["traffic"].get("rejected")  # the answer was taken, not refused
