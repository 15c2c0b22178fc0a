"""`fedmqtt partition`: split a pooled dataset into sites, show per-site label counts, write a manifest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import typer

from fedmqtt.data.partition_view import bin_legend
from fedmqtt.data.partitioners import AUTO_MAX, AUTO_MIN

app = typer.Typer(help="Preview and write a partition of a pooled dataset into sites (docs/algorithms.md 16).")

EXAMPLES = (
    "Examples:\n\n"
    "  fedmqtt partition -f table --path stroke.csv --spec stroke --kind label_skew -k 6 --alpha 0.5 "
    "--cap 500 --out p\n\n"
    "  fedmqtt partition -f table --path my.csv --spec my-columns.toml --kind iid -k 4 --out p\n\n"
    "  fedmqtt partition --data pooled.toml --partition-spec skew.toml --seed 3 --out p\n\n"
    "  fedmqtt partition -f medmnist --path bloodmnist.npz --kind quantity_skew -k 5 --alpha 1 --out p\n\n"
    "  fedmqtt partition -f physionet2012 --path set-a -o cache_dir=/tmp/icu --kind natural "
    "--column ICUType --out p\n\n"
    "  fedmqtt partition -f table --path stroke.csv --spec stroke --kind feature_samples "
    "--column auto_max -k 3 --out p\n\n"
    "  fedmqtt partition -f medmnist --path organamnist.npz --kind adafed_pairs -k 20 --alpha 0.1 --out p\n\n"
    "Spec files: --data holds a data spec (format, path, options; or a site config's data table), "
    "--partition-spec a partition spec (kind, n_sites, alpha, column, cap, seed; or a partition table), "
    "--spec a table's feature spec (label, task, classes, numeric, binary, categorical, drop). Options "
    "given on the command line override the files.\n"
)
OPTION_HELP = ("Format option KEY=VALUE (repeat; VALUE is JSON or text): table spec=stroke or spec=FILE.toml; "
               "medmnist splits='[\"train\"]'; wfdb labels, fs, length; physionet2012 target=los, "
               "cache_dir=DIR, limit=N, masks=true.")
COLUMN_HELP = ("natural: the site column (table: a categorical, binary or drop column; wfdb: source; "
               f"physionet2012: ICUType). feature_*: a numeric feature, or {AUTO_MAX} / {AUTO_MIN} (the "
               "largest / smallest |Pearson r| with the label).")


@app.command("partition", epilog=EXAMPLES)
def partition_command(
    fmt: str | None = typer.Option(None, "--format", "-f", help="Dataset format: heart_disease, table, "
                                      "medmnist, wfdb or physionet2012 (or `format` in --data)."),
    path: Path | None = typer.Option(None, "--path", help="The pooled dataset: a file (table, .npz, UCI "
                                        "file) or a folder (WFDB records, PhysioNet set-a)."),
    option: list[str] = typer.Option([], "--option", "-o", help=OPTION_HELP),
    feature_spec: str | None = typer.Option(None, "--spec", help="table: the feature spec, a name (stroke) "
                                               "or the path of a .toml/.json file (same as -o spec=...)."),
    data_file: Path | None = typer.Option(None, "--data", help="A data-spec file (.toml/.json) naming the "
                                             "pooled dataset: format, path, options."),
    partition_file: Path | None = typer.Option(None, "--partition-spec", help="A partition-spec file "
                                                  "(.toml/.json): kind, n_sites, alpha, column, cap, seed."),
    kind: str | None = typer.Option(None, "--kind", help="natural, iid, label_skew, quantity_skew, "
                                       "feature_intervals, feature_samples or adafed_pairs (Chen et al.'s "
                                       "AdaFed client split; docs/algorithms.md 16.6)."),
    sites: int | None = typer.Option(None, "--sites", "-k", min=1,
                                        help="Number of sites (all kinds but natural)."),
    alpha: float | None = typer.Option(None, help="Dirichlet concentration for label_skew / quantity_skew / "
                                          "adafed_pairs (< 0.1 extreme, >= 10 homogeneous)."),
    column: str | None = typer.Option(None, help=COLUMN_HELP),
    cap: int | None = typer.Option(None, min=1, help="At most this many items per site (random "
                                      "subsample, applied last; the heterogeneity study of "
                                      "docs/algorithms.md 16.5 uses 500)."),
    seed: int | None = typer.Option(None, min=0, help="Seed of the partition's random draws (default 0)."),
    out: Path = typer.Option(..., "--out", help="Folder for partition.json (manifest) and partition.png."),
) -> None:
    """Split a pooled dataset into sites: print each site's size and label counts, write the manifest.

    OUT/partition.json holds per-site indices and histograms (set it as `partition`, with its `site`, in
    a site's data spec); OUT/partition.png shows per-site label counts as a bubble plot.
    """
    from fedmqtt.errors import FedMqttError

    try:
        options = _parse_options(option)
        if feature_spec is not None:
            options["spec"] = feature_spec
        dspec = _data_spec(data_file, fmt, path, options)
        spec = _partition_spec(partition_file, {"kind": kind, "n_sites": sites, "alpha": alpha, "column": column,
                                                "cap": cap, "seed": seed})
        _run(dspec, spec, out)
    except FedMqttError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None


def _data_spec(data_file: Path | None, fmt: str | None, path: Path | None, options: dict[str, Any]) -> Any:
    """The pooled dataset: --data's file with --format/--path/--option on top; relative paths made absolute
    (a feature-spec file against the current folder, as the shell would)."""
    from fedmqtt.data.spec import DataSpec, is_spec_file, load_data_spec
    from fedmqtt.errors import ConfigError

    base: dict[str, Any] = {}
    if data_file is not None:
        base = load_data_spec(data_file).model_dump(exclude_defaults=True)
    if is_spec_file(options.get("spec")):
        options = {**options, "spec": str(Path(options["spec"]).resolve())}
    merged = {**base, **({"format": fmt} if fmt else {}), **({"path": path.resolve()} if path else {}),
              "options": {**base.get("options", {}), **options}}
    if "path" not in merged:
        raise ConfigError("no pooled dataset: give --format and --path, or --data FILE")
    if data_file is None and fmt is None:
        raise ConfigError("no dataset format: give --format (heart_disease, table, medmnist, wfdb, physionet2012)")
    spec = _validated(DataSpec, merged)
    spec.parsed_options()  # a feature-spec file that is missing or invalid fails here, by name
    return spec


def _partition_spec(partition_file: Path | None, given: dict[str, Any]) -> Any:
    """--partition-spec's file with the command-line options on top."""
    from fedmqtt.data.partitioners import PartitionSpec
    from fedmqtt.data.spec import load_partition_spec
    from fedmqtt.errors import ConfigError

    base = load_partition_spec(partition_file).model_dump() if partition_file is not None else {}
    merged = {**base, **{k: v for k, v in given.items() if v is not None}}
    if "kind" not in merged:
        raise ConfigError("no partition kind: give --kind, or --partition-spec FILE")
    return _validated(PartitionSpec, merged)


def _validated(model: Any, data: dict[str, Any]) -> Any:
    from pydantic import ValidationError

    from fedmqtt.errors import ConfigError

    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}"
                                    for e in exc.errors())) from None


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


def _run(dspec: Any, spec: Any, out: Path) -> None:
    from fedmqtt.data.partition_job import prepare_job

    job = prepare_job(dspec, spec)
    if job.rule is not None:  # the manifest records the feature picked; say which
        largest = job.rule == AUTO_MAX
        typer.echo(f"feature: {job.spec.column} ({job.rule}: {'largest' if largest else 'smallest'} |Pearson r|)")
    done = job.run(out)
    _print_table(done.names, done.parts, done.histograms, done.task, done.n_items)
    typer.echo(f"manifest: {done.manifest}\nplot: {done.plot}")


def _print_table(names: list[str], parts: list[np.ndarray], hists: list[dict[str, int]], task: Any,
                 n_items: int) -> None:
    keys = [k for k in hists[0] if any(h.get(k, 0) for h in hists)] if hists else []
    width = max([6, *(len(n) for n in names)])
    typer.echo(f"{'site':<{width}} {'n':>7}  " + " ".join(f"{k:>6}" for k in keys))
    for name, part, hist in zip(names, parts, hists, strict=True):
        typer.echo(f"{name:<{width}} {len(part):>7}  " + " ".join(f"{hist.get(k, 0):>6}" for k in keys))
    used = sum(len(p) for p in parts)
    typer.echo(f"{len(names)} sites, {used} of {n_items} items assigned")
    legend = bin_legend(task.kind, task.label_names, keys)
    if legend:
        typer.echo(legend)
