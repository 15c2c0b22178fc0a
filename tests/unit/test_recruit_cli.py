"""`fedmqtt recruit` offline: the worked example from a partition manifest, with its plot."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from fedmqtt.cli import app

HIST = {"a": [30, 30, 20, 10, 5, 5, 0, 0, 0, 0], "b": [40, 40, 30, 20, 20, 10, 10, 10, 10, 10],
        "c": [0, 0, 0, 0, 0, 0, 0, 0, 5, 20], "d": [16, 16, 16, 16, 0, 0, 0, 0, 0, 0]}
SIZES = {"a": 100, "b": 200, "c": 25, "d": 64}


def test_recruit_preview_from_a_manifest(tmp_path: Path) -> None:
    """The ranking table, the recruited count for gamma_th 0.3 and a PNG, from a manifest file."""
    # Prepare
    manifest = tmp_path / "partition.json"
    manifest.write_text(json.dumps({"sites": [
        {"site": s, "n": SIZES[s], "histogram": {str(k): v for k, v in enumerate(h)}} for s, h in HIST.items()]}))
    png = tmp_path / "recruit.png"
    # Execute
    result = CliRunner().invoke(app, ["recruit", "--manifest", str(manifest), "--gamma-th", "0.3", "--png", str(png),
                                      "--counts", "all"])
    # Assert
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("counts: every item of each site")
    assert [line.split()[1] for line in lines[2:6]] == ["b", "a", "d", "c"]
    assert "recruited 3 of 4" in result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_recruit_needs_a_source() -> None:
    """Without a manifest or live credentials the command says what it needs."""
    result = CliRunner().invoke(app, ["recruit"])
    assert result.exit_code != 0 and "--manifest" in result.output


def test_a_manifest_without_its_pooled_data_says_what_it_ranks(tmp_path: Path) -> None:
    """--counts train (the default) needs the pooled data; without it the preview says it ranks all items."""
    manifest = tmp_path / "partition.json"
    manifest.write_text(json.dumps({"sites": [
        {"site": s, "n": SIZES[s], "histogram": {str(k): v for k, v in enumerate(h)}} for s, h in HIST.items()]}))
    result = CliRunner().invoke(app, ["recruit", "--manifest", str(manifest)])
    assert result.exit_code == 0, result.output
    assert "note: ranking every item of each site instead of its training split" in result.output
    assert "counts: every item of each site" in result.output


def test_offline_preview_ranks_what_the_sites_report_in_a_run(tmp_path: Path) -> None:
    """The preview's histograms and sizes are exactly each site's training split, as `load_site_data` (what a
    site reports in its status) makes it; all-items counts differ and can recruit another number of sites."""
    from test_partition_cli import stroke_csv  # same folder: pytest puts it on sys.path

    from fedmqtt.data.registry import load_site_data
    from fedmqtt.data.spec import DataSpec
    from fedmqtt.recruitment import histogram_vector, label_histogram, recruit
    from fedmqtt.recruitment_view import manifest_reports, manifest_train_reports

    csv, out = stroke_csv(tmp_path, n=400), tmp_path / "p"
    result = CliRunner().invoke(app, ["partition", "-f", "table", "--path", str(csv), "--spec", "stroke",
                                      "--kind", "label_skew", "-k", "12", "--alpha", "0.3", "--seed", "4",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    hists, sizes = manifest_train_reports(out / "partition.json", split_seed=1)
    for site in sizes:
        data = load_site_data(DataSpec(format="table", path=csv, options={"spec": "stroke"}, split_seed=1,
                                       partition=out / "partition.json", site=site))
        assert sizes[site] == data.n_train
        assert hists[site] == histogram_vector(label_histogram("binary", data.y_train, 1))
    all_hists, all_sizes = manifest_reports(out / "partition.json")
    assert all(all_sizes[s] > sizes[s] for s in sizes)
    train_run = recruit(hists, sizes, gamma_th=0.3)
    cli = CliRunner().invoke(app, ["recruit", "--manifest", str(out / "partition.json"), "--split-seed", "1",
                                   "--gamma-th", "0.3"])
    assert cli.exit_code == 0, cli.output
    assert f"recruited {len(train_run.recruited)} of {len(train_run.ranking)}" in cli.output
    assert "counts: each site's training split (split_seed 1" in cli.output
