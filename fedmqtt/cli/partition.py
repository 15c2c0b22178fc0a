"""`fedmqtt partition`: split a pooled dataset into sites, show per-site label counts, write a manifest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
import typer

from fedmqtt.data.partitioners import AUTO_MAX, AUTO_MIN

app = typer.Typer(help="Preview and write a partition of a pooled dataset into sites (docs/algorithms.md 16).")

EXAMPLES = (
    "Examples:\n\n"
    "  fedmqtt partition -f table --path stroke.csv -o spec=stroke --kind label_skew -k 6 --alpha 0.5 "
    "--cap 500 --out p\n\n"
    "  fedmqtt partition -f medmnist --path bloodmnist.npz --kind quantity_skew -k 5 --alpha 1 --out p\n\n"
    "  fedmqtt partition -f physionet2012 --path set-a -o cache_dir=/tmp/icu --kind natural "
    "--column ICUType --out p\n\n"
    "  fedmqtt partition -f table --path stroke.csv -o spec=stroke --kind feature_samples "
    "--column auto_max -k 3 --out p\n"
)
OPTION_HELP = ("Format option KEY=VALUE (repeat; VALUE is JSON or text): table spec=stroke; medmnist "
               "splits='[\"train\"]'; wfdb labels, fs, length; physionet2012 target=los, cache_dir=DIR, "
               "limit=N, masks=true.")
COLUMN_HELP = ("natural: the site column (table: a categorical, binary or drop column; wfdb: source; "
               f"physionet2012: ICUType). feature_*: a numeric feature, or {AUTO_MAX} / {AUTO_MIN} (the "
               "largest / smallest |Pearson r| with the label).")


@app.command("partition", epilog=EXAMPLES)
def partition_command(
    fmt: str = typer.Option(..., "--format", "-f",
                            help="Dataset format: heart_disease, table, medmnist, wfdb or physionet2012."),
    path: Path = typer.Option(..., "--path", help="The pooled dataset: a file (table, .npz, UCI file) or a "
                              "folder (WFDB records, PhysioNet set-a)."),
    option: list[str] = typer.Option([], "--option", "-o", help=OPTION_HELP),
    kind: str = typer.Option(..., "--kind", help="natural, iid, label_skew, quantity_skew, feature_intervals "
                             "or feature_samples."),
    sites: Optional[int] = typer.Option(None, "--sites", "-k", min=1,
                                        help="Number of sites (all kinds but natural)."),
    alpha: Optional[float] = typer.Option(None, help="Dirichlet concentration for label_skew / quantity_skew "
                                          "(< 0.1 extreme, >= 10 homogeneous)."),
    column: Optional[str] = typer.Option(None, help=COLUMN_HELP),
    cap: Optional[int] = typer.Option(None, min=1, help="At most this many items per site (random "
                                      "subsample, applied last; seed 003 uses 500)."),
    seed: int = typer.Option(0, min=0, help="Seed of the partition's random draws."),
    out: Path = typer.Option(..., "--out", help="Folder for partition.json (manifest) and partition.png."),
) -> None:
    """Split a pooled dataset into sites, print each site's size and label counts, and write
    OUT/partition.json (per-site indices and histograms; set it as `partition`, with its `site`, in
    a site's data spec) and OUT/partition.png (per-site label counts as a bubble plot)."""
    from fedmqtt.errors import FedMqttError

    try:
        _run(fmt, path, _parse_options(option), kind, sites, alpha, column, cap, seed, out)
    except FedMqttError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None


def _parse_options(items: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"--option {item!r}: expected KEY=VALUE")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value  # plain text, e.g. spec=stroke
    return options


def _run(fmt: str, path: Path, options: dict[str, Any], kind: str, n_sites: int | None, alpha: float | None,
         column: str | None, cap: int | None, seed: int, out: Path) -> None:
    from pydantic import ValidationError

    from fedmqtt.data.partitioners import (
        PartitionSpec,
        label_histograms,
        partition,
        site_names_for,
        write_partition_manifest,
    )
    from fedmqtt.data.registry import labels_digest, load_dataset
    from fedmqtt.data.spec import DataSpec
    from fedmqtt.errors import ConfigError

    try:
        dspec = DataSpec(format=fmt, path=path.resolve(), options=options)  # type: ignore[arg-type]
        spec = PartitionSpec(kind=kind, n_sites=n_sites, alpha=alpha, column=column,  # type: ignore[arg-type]
                             cap=cap, seed=seed)
    except ValidationError as exc:
        raise ConfigError("; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}"
                                    for e in exc.errors())) from None
    data = load_dataset(dspec)
    rule = spec.column if spec.column in (AUTO_MAX, AUTO_MIN) else None
    spec, groups = _resolve_column(spec, data)
    parts = partition(spec, data.class_labels(), features=data.features, groups=groups, n_items=len(data))
    names = site_names_for(spec, groups)
    hists = label_histograms(data.y, parts, data.task)
    source = {"format": fmt, "path": str(dspec.path), "options": options, "n_items": len(data),
              "labels_sha256": labels_digest(data.y), "task": data.task.kind,
              "label_names": list(data.task.label_names), **({"column_rule": rule} if rule else {})}
    write_partition_manifest(out / "partition.json", spec, parts, hists, source, site_names=names)
    _print_table(names, parts, hists, data.task.label_names, len(data))
    plot_partition(names, hists, out / "partition.png", title=_title(spec))
    typer.echo(f"manifest: {out / 'partition.json'}\nplot: {out / 'partition.png'}")


def _resolve_column(spec: Any, data: Any) -> tuple[Any, np.ndarray | None]:
    """The natural partition's group values; for auto_max/auto_min, the spec with the feature picked."""
    from fedmqtt.data.partitioners import pick_feature
    from fedmqtt.errors import DataError

    if spec.kind == "natural":
        if spec.column not in data.groups:
            raise DataError(f"no site column {spec.column!r} in this dataset; "
                            f"columns: {', '.join(data.groups) or '(none)'}")
        return spec, data.groups[spec.column]
    if spec.column in (AUTO_MAX, AUTO_MIN):  # record the feature used, so the manifest reads without the rule
        labels = data.class_labels() if data.class_labels() is not None else data.y
        largest = spec.column == AUTO_MAX
        picked = pick_feature(data.features, labels, largest=largest)
        typer.echo(f"feature: {picked} ({spec.column}: {'largest' if largest else 'smallest'} |Pearson r|)")
        return spec.model_copy(update={"column": picked}), None
    return spec, None


def _title(spec: Any) -> str:
    params = [f"{k}={v}" for k, v in (("alpha", spec.alpha), ("column", spec.column), ("cap", spec.cap)) if v]
    return f"{spec.kind} ({', '.join([*params, f'seed={spec.seed}'])})"


def _print_table(names: list[str], parts: list[np.ndarray], hists: list[dict[str, int]],
                 label_names: tuple[str, ...], n_items: int) -> None:
    keys = [k for k in hists[0] if any(h.get(k, 0) for h in hists)] if hists else []
    width = max([6, *(len(n) for n in names)])
    typer.echo(f"{'site':<{width}} {'n':>7}  " + " ".join(f"{k:>6}" for k in keys))
    for name, part, hist in zip(names, parts, hists):
        typer.echo(f"{name:<{width}} {len(part):>7}  " + " ".join(f"{hist.get(k, 0):>6}" for k in keys))
    used = sum(len(p) for p in parts)
    typer.echo(f"{len(names)} sites, {used} of {n_items} items assigned")
    named = [(k, label_names[int(k)]) for k in keys if int(k) < len(label_names)]
    legend = [f"{k}={name}" for k, name in named if name != k]
    if legend:
        typer.echo("labels: " + ", ".join(legend))


def plot_partition(names: list[str], hists: list[dict[str, int]], path: Path, *, title: str = "") -> None:
    """Per-site label counts as a bubble plot (area proportional to the count, the count written beside)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(hists[0]) if hists else []
    counts = np.asarray([[h.get(k, 0) for k in keys] for h in hists], dtype=np.float64)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * len(names) + 2), max(3.0, 0.35 * len(keys) + 1.5)))
    if counts.size and counts.max() > 0:
        xs, ys = np.meshgrid(np.arange(len(names)), np.arange(len(keys)), indexing="ij")
        sizes = 900.0 * counts / counts.max()
        ax.scatter(xs.ravel(), ys.ravel(), s=sizes.ravel(), color="tab:red", alpha=0.6)
        for (i, j), c in np.ndenumerate(counts):
            if c:  # the label sits just right of the bubble (radius in points = sqrt(area) / 2)
                ax.annotate(f"{int(c)}", (i, j), xytext=(np.sqrt(sizes[i, j]) / 2 + 2, 0),
                            textcoords="offset points", fontsize=7, va="center")
    many = len(names) > 8
    ax.set_xticks(range(len(names)), names, rotation=45 if many else 0, ha="right" if many else "center")
    ax.set_yticks(range(len(keys)), keys)
    ax.set_xlim(-0.7, len(names) - 0.3)
    ax.set_ylim(-0.7, len(keys) - 0.3)
    ax.set_xlabel("site")
    ax.set_ylabel("label (class, label index or LoS bin)")
    ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
