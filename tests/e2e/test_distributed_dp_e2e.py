"""Distributed DP with real processes (broker, PS and four heart-disease sites through the CLI): DP-FedAvg under
secure aggregation with `distributed_dp = "skellam"`. The released model differs from DP-FedAvg's in the clear
without noise (the same clipped changes, the same fixed denominator) by noise of exactly the std the plan gives
for four sites' shares, centred on 0, and the report charges the round the Skellam epsilon of that noise."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from harness import FAST_TRAIN
from safetensors.numpy import load_file

from fedmqtt.demo import DEMO_MODEL
from fedmqtt.secagg.skellam import SkellamPlan, skellam_epsilon
from fedmqtt.simulation import SimulationConfig, bundled_sites, run_simulation
from schemas import messages as m

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SITES = ("cleveland", "hungary", "switzerland", "va")
SECURE = {"enabled": True, "ring_bits": 64, "fraction_bits": 30, "clip": 8.0, "stage_timeout_s": 8.0,
          "distributed_dp": "skellam"}
CLIP, Z = 0.5, 0.5


def test_distributed_dp_round_adds_the_planned_noise_and_charges_its_epsilon(cli_federation, tmp_path) -> None:  # noqa: ANN001
    hyper = {"clip_norm": CLIP, "noise_multiplier": Z}
    fed = cli_federation("ddp", run_id="e2e-ddp", rounds=1, sites=SITES, algorithm="dp-fedavg", hyper=hyper,
                         ps_extra={"secure_aggregation": SECURE})
    fed.run_to_completion(300)
    sim = SimulationConfig(run_id="e2e-ddp", algorithm="dp-fedavg", hyper={"clip_norm": CLIP, "noise_multiplier": 0.0},
                           rounds=1, seed=0, out_dir=tmp_path / "sim", model=DEMO_MODEL, train=FAST_TRAIN,
                           sites={s: d for s, d in bundled_sites().items() if s in SITES})
    run_simulation(sim, progress=False)
    clear = load_file(str(tmp_path / "sim" / "final_model.safetensors"))
    got = fed.final_weights()
    assert sorted(got) == sorted(clear)
    floats = sorted(n for n, v in clear.items() if v.dtype.kind == "f")
    diff = np.concatenate([got[n].astype(np.float64).ravel() - clear[n].astype(np.float64).ravel() for n in floats])
    plan = SkellamPlan(CLIP, Z, len(SITES), int(SECURE["fraction_bits"]), diff.size)
    want = plan.sum_std(len(SITES)) / len(SITES)  # the noise of four shares, over m = 4
    assert diff.std() == pytest.approx(want, rel=0.15), (diff.std(), want)
    assert abs(diff.mean()) < 5 * want / math.sqrt(diff.size)
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    record = report["rounds"][0]
    assert record["secure"]["included"] == sorted(SITES)
    assert record["server"]["sites_in_sum"] == 4.0
    expected = skellam_epsilon([(plan.l1, plan.l2, len(SITES) * plan.site_variance)], 1e-5)
    assert record["server"]["epsilon"] == pytest.approx(expected, rel=1e-9)
    # the run's participant-level spending, as ps/status carried it: by the Skellam bound, one round charged
    assert report["privacy"]["participant_level"]["final"] == {
        "epsilon": record["server"]["epsilon"], "delta": 1e-5, "accountant": "skellam", "rounds": 1, "round": 1}
    assert "| 1 | " in (fed.work / "ps" / "report.md").read_text().split("## Differential privacy")[1]
    final = fed.retained_ps_status()  # what a newcomer (the dashboard) reads from the broker
    assert isinstance(final, m.DaemonStatus) and final.state == "done"
    assert final.participant_dp is not None
    assert final.participant_dp.model_dump() == report["privacy"]["participant_level"]["final"]
    for site in SITES:
        assert "Traceback" not in fed.tail(site, 2000)
        assert "refused" not in fed.tail(site, 2000)
