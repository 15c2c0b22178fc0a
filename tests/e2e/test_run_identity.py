"""Run identity: a fresh start is never mistaken for a replay, checkpoints are never silently dropped, and a
configuration that cannot progress says so instead of waiting in silence."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from harness import FAST_TRAIN, CliFederation
from safetensors.numpy import load_file

from fedmqtt.demo import DEMO_MODEL
from fedmqtt.simulation import SimulationConfig, bundled_sites, run_simulation
from schemas import messages as m

pytestmark = pytest.mark.slow
SITES = ("cleveland", "hungary")
ROUNDS = 3


def _simulated(tmp_path, run_id: str) -> dict[str, np.ndarray]:  # noqa: ANN001
    sim = SimulationConfig(run_id=run_id, algorithm="fedavg", rounds=ROUNDS, seed=0, out_dir=tmp_path / "sim",
                           model=DEMO_MODEL, train=FAST_TRAIN,
                           sites={s: d for s, d in bundled_sites().items() if s in SITES})
    run_simulation(sim, progress=False)
    return load_file(str(tmp_path / "sim" / "final_model.safetensors"))


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_fresh_start_needs_force_and_running_sites_follow_the_new_session(cli_federation, tmp_path) -> None:  # noqa: ANN001
    fed: CliFederation = cli_federation("again", run_id="e2e-again", rounds=ROUNDS, sites=SITES,
                                        ps_extra={"quorum": len(SITES)})
    fed.start_broker()
    fed.start_ps()
    for site in SITES:
        fed.start_site(site)
    first = fed.wait_message(lambda msg: isinstance(msg, m.RoundMetrics) and msg.round == 2, 120, "round 2 closed")
    assert isinstance(first, m.RoundMetrics)
    fed.kill("ps")

    # Without --resume or --force the checkpoints are not silently thrown away.
    refused = subprocess.run([sys.executable, "-m", "fedmqtt", "ps", "start", "--config", str(fed.ps_config)],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0
    assert "--resume" in refused.stderr + refused.stdout and "--force" in refused.stderr + refused.stdout

    # --force: same run id, same seed, so the same round-1 model bytes; the sites kept running and must not
    # take it for the model they already trained on.
    fed.start_ps(extra=("--force",))
    fed.wait_ps_done(180)
    _assert_same(fed.final_weights(), _simulated(tmp_path, "e2e-again"))
    site_log = (fed.logs / "cleveland.log").read_text(errors="replace")
    assert "the PS started afresh" in site_log


def test_resume_before_round_one_closed_starts_from_the_config(cli_federation, tmp_path) -> None:  # noqa: ANN001
    fed: CliFederation = cli_federation("early", run_id="e2e-early", rounds=ROUNDS, sites=SITES,
                                        ps_extra={"quorum": len(SITES)})
    fed.start_broker()
    fed.start_ps()
    fed.wait_message(lambda msg: isinstance(msg, m.DaemonStatus) and msg.state == "waiting_for_sites", 60,
                     "the PS waiting for sites")
    fed.kill("ps")
    fed.start_ps(resume=True)
    for site in SITES:
        fed.start_site(site)
    fed.wait_ps_done(180)
    _assert_same(fed.final_weights(), _simulated(tmp_path, "e2e-early"))
    assert "no checkpoint in" in (fed.logs / "ps.log").read_text(errors="replace")


def test_recruitment_without_histograms_says_why_it_cannot_start(cli_federation) -> None:  # noqa: ANN001
    fed: CliFederation = cli_federation("blind", run_id="e2e-blind", rounds=2, sites=SITES,
                                        share_label_histogram=False, ps_extra={"selection": "recruited"})
    fed.start_broker()
    fed.start_ps()
    for site in SITES:
        fed.start_site(site)
    status = fed.wait_message(lambda msg: isinstance(msg, m.DaemonStatus) and "share_label_histogram" in msg.detail,
                              60, "a status that names the missing label histograms")
    assert isinstance(status, m.DaemonStatus)
    assert status.state == "waiting_for_sites"
    assert all(site in status.detail for site in SITES)
