"""Federated feature statistics with data that have no columns (images), over a real broker and real processes:
each site stays up and says in an "error" status why it cannot take part (its data have no per-column statistics;
the fix is feature_statistics = "site"), and the PS, which has no summary to combine, starts no round and shows
each site's reason in ps/status. Before, the site agent raised at start and the PS waited without a word."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from harness import FAST_TRAIN

from fedmqtt.config_io import dump_toml, read_toml
from schemas import messages as m

pytestmark = pytest.mark.e2e
SITES = ("cleveland", "hungary")


def _images(path: Path) -> Path:
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", 20), ("val", 6), ("test", 6)):
        arrays[f"{split}_images"] = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, 2, size=(n, 1), dtype=np.uint8)
    np.savez(path, **arrays)
    return path


def test_sites_without_columns_report_why_and_the_ps_shows_it(cli_federation, tmp_path: Path) -> None:  # noqa: ANN001
    # Prepare: both hospitals hold images, and both configs ask for the federation's feature statistics
    fed = cli_federation("fstats-images", run_id="e2e-fstats-images", rounds=1, sites=SITES, train=FAST_TRAIN,
                         model={"name": "lenet5", "args": {"n_classes": 1}},
                         ps_extra={"quorum": 2, "feature_statistics": "federated"})
    for site in SITES:
        config = read_toml(fed.site_configs[site])
        config["feature_statistics"] = "federated"
        config["data"] = {"format": "medmnist", "path": str(_images(tmp_path / f"{site}.npz"))}
        fed.site_configs[site].write_text(dump_toml(config))
    # Execute
    fed.start_broker()
    fed.start_ps()
    for site in SITES:
        fed.start_site(site)

    # Assert: the PS waits for both summaries and says what each site reports
    def shows_both(msg: object) -> bool:
        return isinstance(msg, m.DaemonStatus) and all(f"{s} reports: cannot take part" in msg.detail for s in SITES)

    status = fed.wait_message(shows_both, 90, "ps/status naming both sites' reasons")
    assert isinstance(status, m.DaemonStatus)
    assert status.state == "waiting_for_sites" and status.round == 0
    assert "waiting for feature summaries from sites cleveland, hungary" in status.detail
    assert "not image data" in status.detail and 'set feature_statistics = \\"site\\"' not in status.detail
    assert 'feature_statistics = "site"' in status.detail
    fed.check_alive()  # nobody crashed: the sites wait, saying why
    for site in SITES:
        log = fed.tail(site, 200)
        assert "Traceback" not in log
        assert "cannot take part in federated feature statistics" in log
        assert "round 1" not in log  # nothing trained on data the federation did not standardise
