"""Adaptive clipping under distributed DP with real processes (broker, PS and four heart-disease sites through the
CLI): over two rounds the PS moves the clip from the noised count of clipped sites it unmasks, the second round is
clipped and calibrated at the new clip, and the report charges both rounds' change and count releases."""

from __future__ import annotations

import json
import math

import pytest

from fedmqtt.secagg.skellam import SkellamPlan, skellam_epsilon

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SITES = ("cleveland", "hungary", "switzerland", "va")
SECURE = {"enabled": True, "ring_bits": 64, "fraction_bits": 30, "clip": 8.0, "stage_timeout_s": 8.0,
          "distributed_dp": "skellam"}
HYPER = {"clip_norm": 0.5, "noise_multiplier": 0.5, "target_quantile": 0.5, "clip_lr": 0.2, "count_stddev": 0.4}


def test_adaptive_clipping_moves_the_clip_from_the_count_summed_under_secure_aggregation(cli_federation) -> None:  # noqa: ANN001
    fed = cli_federation("ddp-adaptive", run_id="e2e-ddp-adaptive", rounds=2, sites=SITES, algorithm="dp-fedavg",
                         hyper=HYPER, ps_extra={"secure_aggregation": SECURE})
    fed.run_to_completion(300)
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    first, second = (r["server"] for r in report["rounds"])
    assert first["clip_norm"] == 0.5 and first["sites_in_sum"] == 4.0
    # the noised fraction within the clip, and C moved by Andrew et al.'s geometric step from it
    assert first["next_clip_norm"] == pytest.approx(0.5 * math.exp(-0.2 * (first["noisy_unclipped_fraction"] - 0.5)))
    assert second["clip_norm"] == pytest.approx(first["next_clip_norm"])  # the second round ran at the new clip
    z_d = (0.5**-2 - 0.8**-2) ** -0.5
    dim = sum(int(v.size) for v in fed.final_weights().values() if v.dtype.kind == "f")  # what the sites summed
    releases = []
    for server in (first, second):
        plan = SkellamPlan(server["clip_norm"], z_d, 4, int(SECURE["fraction_bits"]), dim, 0.4)
        releases += plan.releases(4)
    assert second["epsilon"] == pytest.approx(skellam_epsilon(releases, 1e-5), rel=1e-9)
    for site in SITES:
        assert "Traceback" not in fed.tail(site, 2000)
        assert "refused" not in fed.tail(site, 2000)
