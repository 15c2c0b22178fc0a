"""What `fedmqtt recruit` ranks and draws: sites' label histograms and sizes, read live or from a manifest.

A run ranks each site by what it reports in its status: the label counts and size of its TRAINING
split (DataSpec.fractions, 60 % by default, drawn with its split_seed). A partition manifest holds each
site's counts over ALL its items. The two rankings can differ (a site near the threshold moves), so the
offline preview re-draws every site's training split, as the site will, whenever it can read the pooled
dataset the manifest was made from (`manifest_train_reports`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedmqtt.recruitment import Recruitment, histogram_vector, label_histogram

Reports = tuple[dict[str, Any], dict[str, int]]  # site -> histogram vector, site -> size


def live_reports(credentials: Path, run_id: str, listen_s: float) -> Reports:
    """Histograms and training-set sizes from the sites' retained status messages (any reader of
    site/+/status)."""
    from fedmqtt.transport import topics
    from fedmqtt.transport.channel import Channel
    from fedmqtt.transport.mqtt import MqttTransport
    from fedmqtt.transport.settings import load_credentials
    from fedmqtt.transport.signing import load_identity
    from schemas.messages import SiteStatus

    settings = load_credentials(credentials)
    identity = load_identity(credentials, run_id=run_id)  # verifies what the sites signed
    seat = "3" if settings.username == "observer" else None  # its own login (watch: 1, dashboard: 2)
    transport = MqttTransport(settings, client_id=f"fedmqtt-recruit-{int(time.time() * 1000) % 10**9}",
                              seat=seat).connect()
    channel = Channel(transport, run_id=run_id, identity=identity)
    transport.subscribe([topics.any_site_filter(run_id, "status"), topics.federation_keys_topic(run_id)])
    hists: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    end = time.monotonic() + listen_s
    try:
        while time.monotonic() < end:
            inbound = channel.receive(0.2)
            if inbound is not None and isinstance(inbound.message, SiteStatus) and inbound.message.state != "offline":
                site = inbound.topic.site_id or ""
                hists[site] = histogram_vector(inbound.message.label_histogram)
                sizes[site] = inbound.message.n_train
    finally:
        transport.close()
    return hists, sizes


def manifest_reports(path: Path) -> Reports:
    """Histograms and sizes over every item of each site, as a `fedmqtt partition` manifest lists them."""
    data = json.loads(Path(path).read_text())
    sites = data["sites"]
    hists = {s["site"]: histogram_vector({str(k): v for k, v in s["histogram"].items()}) for s in sites}
    return hists, {s["site"]: int(s["n"]) for s in sites}


def manifest_train_reports(path: Path, *, split_seed: int = 0,
                           fractions: tuple[float, float, float] = (0.6, 0.2, 0.2)) -> Reports:
    """What each site of a manifest will report in a run: its training split's label counts and size.

    Reads the pooled dataset named in the manifest's source once, then for each site does what
    `load_site_data` does before training: its items, labelled ones only, the seeded train/val/test split.

    Raises:
        FedMqttError: the manifest has no readable source, or the data no longer matches it.
    """
    from fedmqtt.data.partitioners import read_partition_manifest
    from fedmqtt.data.registry import labels_digest, load_dataset
    from fedmqtt.data.spec import DataSpec
    from fedmqtt.data.splits import split_indices
    from fedmqtt.errors import DataError

    manifest = read_partition_manifest(Path(path))
    source = manifest.source
    if not source.get("path"):
        raise DataError(f"{path}: the manifest names no pooled dataset (source.path)")
    data = load_dataset(DataSpec(format=source.get("format", "heart_disease"), path=Path(source["path"]),
                                 options=source.get("options", {})))
    digest = labels_digest(data.y)
    if source.get("n_items") != len(data) or source.get("labels_sha256", digest) != digest:
        raise DataError(f"{path}: {source['path']} no longer holds the data the manifest was made from")
    labelled = data.labelled()
    stratify = data.task.kind in ("binary", "multiclass")
    hists: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    for part in manifest.sites:
        idx = np.asarray(part.indices, dtype=np.int64)
        y = data.y[idx[labelled[idx]]]
        if len(y) < 3:  # too small to split: the site would refuse to start
            continue
        train, _, _, _ = split_indices(y, seed=split_seed, fractions=fractions, stratify=stratify)
        hists[part.site] = histogram_vector(label_histogram(data.task.kind, y[train], data.task.n_outputs))
        sizes[part.site] = int(len(train))
    return hists, sizes


def plot_recruitment(r: Recruitment, path: Path) -> None:
    """Cumulative representativeness by rank, the threshold iota, recruited sites highlighted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    scores = [c.score for c in r.ranking]
    running = [sum(scores[: k + 1]) for k in range(len(scores))]
    colours = ["tab:green" if c.site_id in r.recruited else "tab:grey" for c in r.ranking]
    fig, ax = plt.subplots(figsize=(max(6, len(scores) * 0.12 + 4), 4))
    ax.bar(range(1, len(scores) + 1), scores, color=colours, label="nu_c (green: recruited)")
    ax.plot(range(1, len(scores) + 1), running, "k.-", label="cumulative nu")
    ax.axhline(r.threshold, color="tab:red", linestyle="--", label=f"threshold iota = {r.threshold:.3f}")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("rank (most representative first)")
    ax.set_ylabel("representativeness score nu (lower is better)")
    ax.set_title(f"recruited {len(r.recruited)} of {len(scores)} sites")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
