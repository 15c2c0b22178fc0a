"""One valid message of each federated-feature-statistics kind, for the codec's and the hostile-wire tables."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel

from fedmqtt.data.feature_stats import column_grid, summarise
from fedmqtt.data.feature_wire import combine_messages, summary_message


def feature_examples(run_id: str, site: str = "site-a") -> list[BaseModel]:
    rng = np.random.default_rng(0)
    x = np.column_stack([rng.normal(7.4, 0.05, 40), (rng.random(40) < 0.4).astype(float)])
    grid = column_grid(("pH", "flag"), {"pH": (6.5, 8.0)}, bins=16)
    summary = summary_message(summarise(x, grid), grid, ("pH", "flag"), run_id=run_id, sender=site)
    return [summary, combine_messages([summary], run_id=run_id)]
