"""`fedmqtt recruit`: preview client recruitment (docs/algorithms.md 15) for given gammas, from live sites or
a partition manifest."""

from __future__ import annotations

from pathlib import Path

import typer

from fedmqtt.recruitment import recruit
from fedmqtt.recruitment_view import live_reports, manifest_reports, manifest_train_reports, plot_recruitment

__all__ = ["app", "live_reports", "manifest_reports", "plot_recruitment", "recruit_command"]

app = typer.Typer(help="Preview client recruitment (docs/algorithms.md 15).")


@app.command("recruit")
def recruit_command(
    gamma_dv: float = typer.Option(0.5, help="Weight of the label-distribution divergence."),
    gamma_sa: float = typer.Option(0.5, help="Weight of the sample-size term n^-1/2."),
    gamma_th: float = typer.Option(0.1, min=0.0, max=1.0, help="Threshold share of the total score."),
    manifest: Path | None = typer.Option(None, help="Offline: a partition manifest (fedmqtt partition)."),
    counts: str = typer.Option("train", help="Offline: rank by each site's training split, as a run does "
                               "(train: re-drawn from the pooled data the manifest names), or by all its "
                               "items, as the manifest lists them (all)."),
    split_seed: int = typer.Option(0, min=0, help="Offline, --counts train: the sites' split_seed (data spec; "
                                   "default 0), with the default fractions 0.6/0.2/0.2."),
    credentials: Path | None = typer.Option(None, help="Live: credentials that may read site/+/status."),
    run_id: str | None = typer.Option(None, "--run-id", help="Live: the run whose sites to rank."),
    listen: float = typer.Option(3.0, help="Live: seconds to collect the sites' retained statuses."),
    png: Path | None = typer.Option(None, help="Write the cumulative-score plot here."),
) -> None:
    """Rank sites by representativeness and show who would be recruited (docs/algorithms.md 15).

    A run ranks the label counts and sizes of each site's training split (what a site reports). From a
    manifest, the preview re-draws those splits when the pooled dataset is readable, so both agree;
    --counts all ranks every item instead, and can recruit a different number of sites.
    """
    from fedmqtt.errors import FedMqttError

    if counts not in ("train", "all"):
        raise typer.BadParameter("--counts is train or all")
    if manifest is not None:
        hists, sizes, what = _offline(manifest, counts, split_seed)
    elif credentials is not None and run_id is not None:
        hists, sizes = live_reports(credentials, run_id, listen)
        what = "the training split each site reports in its status (live)"
    else:
        raise typer.BadParameter("give --manifest FILE, or --credentials FILE with --run-id")
    try:
        r = recruit(hists, sizes, gamma_dv=gamma_dv, gamma_sa=gamma_sa, gamma_th=gamma_th)
    except FedMqttError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo(f"counts: {what}")
    typer.echo(f"{'rank':>4}  {'site':<16} {'n':>7} {'divergence':>10} {'score':>8}  recruited")
    for k, c in enumerate(r.ranking):
        typer.echo(f"{k + 1:>4}  {c.site_id:<16} {c.n:>7} {c.divergence:>10.4f} {c.score:>8.4f}  "
                   f"{'yes' if c.site_id in r.recruited else 'no'}")
    for site in r.unrankable:
        typer.echo(f"   -  {site:<16} shares no label histogram: not rankable")
    typer.echo(f"recruited {len(r.recruited)} of {len(r.ranking)} (threshold {r.threshold:.4f} = "
               f"{gamma_th} x {r.total:.4f})")
    if png is not None:
        plot_recruitment(r, png)
        typer.echo(f"plot: {png}")


def _offline(manifest: Path, counts: str, split_seed: int) -> tuple[dict, dict, str]:
    """The manifest's sites as a run would see them (training splits), or all their items."""
    from fedmqtt.errors import FedMqttError

    if counts == "train":
        try:
            hists, sizes = manifest_train_reports(manifest, split_seed=split_seed)
            return hists, sizes, (f"each site's training split (split_seed {split_seed}, fractions "
                                  "0.6/0.2/0.2), as the sites report them in a run")
        except FedMqttError as exc:
            reason = str(exc)
        except (KeyError, ValueError) as exc:  # a hand-written manifest without source or indices
            reason = f"the manifest has no pooled-data source ({exc.__class__.__name__}: {exc})"
        typer.echo(f"note: ranking every item of each site instead of its training split: {reason}. A run "
                   "ranks the training split, so it can recruit a different number of sites.", err=True)
    hists, sizes = manifest_reports(manifest)
    return hists, sizes, "every item of each site, as the manifest lists them (a run ranks the training split)"
