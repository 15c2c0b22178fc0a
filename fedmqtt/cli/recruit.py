"""`fedmqtt recruit`: preview seed 002's recruitment for given gammas, from live sites or a partition."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import typer

from fedmqtt.recruitment import Recruitment, histogram_vector, recruit

app = typer.Typer(help="Preview client recruitment (seed 002).")


def live_reports(credentials: Path, run_id: str, listen_s: float) -> tuple[dict[str, Any], dict[str, int]]:
    """Histograms and sizes from the sites' retained status messages (any reader of site/+/status)."""
    from fedmqtt.config_io import load_toml
    from fedmqtt.transport import topics
    from fedmqtt.transport.channel import Channel
    from fedmqtt.transport.mqtt import MqttTransport
    from fedmqtt.transport.settings import BrokerSettings
    from schemas.messages import SiteStatus

    settings = load_toml(credentials, BrokerSettings, section="broker")
    seat = "3" if settings.username == "observer" else None  # its own login (watch: 1, dashboard: 2)
    transport = MqttTransport(settings, client_id=f"fedmqtt-recruit-{int(time.time() * 1000) % 10**9}",
                              seat=seat).connect()
    channel = Channel(transport, run_id=run_id, sender="observer")
    transport.subscribe([topics.any_site_filter(run_id, "status")])
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


def manifest_reports(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """Histograms and sizes from a `fedmqtt partition` manifest (offline preview)."""
    data = json.loads(Path(path).read_text())
    sites = data["sites"]
    hists = {s["site"]: histogram_vector({str(k): v for k, v in s["histogram"].items()}) for s in sites}
    return hists, {s["site"]: int(s["n"]) for s in sites}


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


@app.command("recruit")
def recruit_command(
    gamma_dv: float = typer.Option(0.5, help="Weight of the label-distribution divergence."),
    gamma_sa: float = typer.Option(0.5, help="Weight of the sample-size term n^-1/2."),
    gamma_th: float = typer.Option(0.1, min=0.0, max=1.0, help="Threshold share of the total score."),
    manifest: Optional[Path] = typer.Option(None, help="Offline: a partition manifest (fedmqtt partition)."),
    credentials: Optional[Path] = typer.Option(None, help="Live: credentials that may read site/+/status."),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="Live: the run whose sites to rank."),
    listen: float = typer.Option(3.0, help="Live: seconds to collect the sites' retained statuses."),
    png: Optional[Path] = typer.Option(None, help="Write the cumulative-score plot here."),
) -> None:
    """Rank sites by representativeness and show who would be recruited (docs/algorithms.md 15)."""
    if manifest is not None:
        hists, sizes = manifest_reports(manifest)
    elif credentials is not None and run_id is not None:
        hists, sizes = live_reports(credentials, run_id, listen)
    else:
        raise typer.BadParameter("give --manifest FILE, or --credentials FILE with --run-id")
    r = recruit(hists, sizes, gamma_dv=gamma_dv, gamma_sa=gamma_sa, gamma_th=gamma_th)
    typer.echo(f"{'rank':>4}  {'site':<16} {'n':>7} {'divergence':>10} {'score':>8}  recruited")
    for k, c in enumerate(r.ranking):
        typer.echo(f"{k + 1:>4}  {c.site_id:<16} {c.n:>7} {c.divergence:>10.4f} {c.score:>8.4f}  "
                   f"{'yes' if c.site_id in r.recruited else 'no'}")
    for site in r.unrankable:
        typer.echo(f"   -  {site:<16} shares no label histogram: not rankable")
    typer.echo(f"recruited {len(r.recruited)} of {len(r.ranking)} (threshold {r.threshold:.4f} = {gamma_th} x {r.total:.4f})")
    if png is not None:
        plot_recruitment(r, png)
        typer.echo(f"plot: {png}")
