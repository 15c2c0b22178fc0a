"""The end of a run: the final and best models, the report, and the final metrics on ps/metrics."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedmqtt.atomic import private_dir, replace_atomic, write_private_text
from fedmqtt.transport import topics
from fedmqtt.transport.channel import Channel
from ps_daemon.checkpoint import best_weights, drop_read_pages
from ps_daemon.config import DaemonConfig
from ps_daemon.model_init import init_record
from ps_daemon.report import build_report, per_site_csv, render_markdown
from ps_daemon.state import DaemonState
from ps_daemon.status import PS
from schemas import messages as m

log = logging.getLogger("fedmqtt.ps")


def write_final_outputs(config: DaemonConfig, channel: Channel, state: DaemonState, *, started_at: float,
                        usage: dict[int, dict[str, dict[str, Any]]],
                        privacy: dict[str, dict[str, Any]] | None = None) -> None:
    """Write the final and best models and the report (private to the PS), and publish the final metrics.
    `privacy`: the record-level DP each site reported with its newest accepted update."""
    c, out = config, private_dir(config.out_dir)
    models = {"final": str(out / "final_model.safetensors")}
    final = {**state.weights, **state.extras.get("eval", {})}  # FedDyn's deployed model is theta_avg
    _save_model(Path(models["final"]), final)
    drop_read_pages(final)  # read through maps of the newest checkpoint; the best model is loaded next
    if state.best is not None:
        models["best"] = str(out / "best_model.safetensors")
        _save_model(Path(models["best"]), best_weights(state.best))
    traffic = {"bytes_sent": channel.bytes_sent, "bytes_received": channel.bytes_received,
               "chunked_transfers": vars(channel.fetcher.stats),
               "messages_received": channel.stats.received, "duplicates": channel.stats.duplicates,
               "rejected": dict(channel.stats.rejected)}
    finished_at = time.time()
    timings = {"started_at": started_at, "finished_at": finished_at, "total_s": finished_at - started_at}
    report = build_report(c, state, timings=timings, traffic=traffic, models=models, usage=usage, privacy=privacy,
                          init_model=init_record(c))
    write_private_text(out / "report.json", json.dumps(report, indent=2))
    write_private_text(out / "report.md", render_markdown(report))
    write_private_text(out / "per_site.csv", per_site_csv(report))
    mean_test = report["final"]["mean"].get("test", {})
    per_site = {s: e.get("metrics", {}).get("test", {}) for s, e in report["final"]["per_site"].items()}
    channel.send(topics.ps_metrics_topic(c.run_id), m.RoundMetrics(
        run_id=c.run_id, sender=PS, round=state.round, phase="final", sites=tuple(state.final_reports),
        per_site=per_site, mean=mean_test))
    log.info("run finished; report in %s", out / "report.json")


def _save_model(path: Path, weights: dict[str, np.ndarray]) -> None:
    """A safetensors file, 0600 and never torn (fedmqtt.atomic)."""
    from safetensors.numpy import save_file

    # safetensors writes straight from each array's memory: contiguous arrays are not copied first
    contiguous = {k: np.require(v, requirements="C") for k, v in weights.items()}
    replace_atomic(path, lambda tmp: save_file(contiguous, str(tmp)))
