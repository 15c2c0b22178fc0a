"""`fedmqtt partition`: the per-site table, the manifest a site can load, the PNG, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from fedmqtt.cli.partition import app
from fedmqtt.data.partitioners import read_partition_manifest
from fedmqtt.data.registry import load_site_data
from fedmqtt.data.spec import DataSpec

HEADER = ("id,gender,age,hypertension,heart_disease,ever_married,work_type,Residence_type,avg_glucose_level,"
          "bmi,smoking_status,stroke")


def stroke_csv(tmp_path: Path, n: int = 60) -> Path:
    rows = [f"{k},{'Male' if k % 2 else 'Female'},{20 + k},0,0,Yes,Private,{'Urban' if k % 3 else 'Rural'},"
            f"{100 + (k * 7) % 50},{'N/A' if k % 9 == 0 else 20 + k % 11},never smoked,{int(k % 4 == 0)}"
            for k in range(n)]
    path = tmp_path / "stroke.csv"
    path.write_text(HEADER + "\n" + "\n".join(rows) + "\n")
    return path


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


def test_label_skew_table_manifest_and_png(tmp_path: Path) -> None:
    """A per-site table, partition.json (indices, histograms), a PNG; a site loads its part."""
    # Prepare
    csv, out = stroke_csv(tmp_path), tmp_path / "out"
    # Execute
    code, output = invoke("-f", "table", "--path", str(csv), "-o", "spec=stroke", "--kind", "label_skew",
                          "--sites", "3", "--alpha", "0.5", "--cap", "25", "--seed", "1", "--out", str(out))
    # Assert
    assert code == 0, output
    lines = output.splitlines()
    assert lines[0].split() == ["site", "n", "0", "1"] and [ln.split()[0] for ln in lines[1:4]] == [
        "site-0", "site-1", "site-2"]
    manifest = read_partition_manifest(out / "partition.json")
    assert manifest.spec.cap == 25 and manifest.source["n_items"] == 60
    assert manifest.source["options"] == {"spec": "stroke"}
    for line, site in zip(lines[1:4], manifest.sites, strict=True):
        assert int(line.split()[1]) == site.n == len(site.indices) <= 25
        assert [int(v) for v in line.split()[2:]] == [site.histogram["0"], site.histogram["1"]]
    assert (out / "partition.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    spec = DataSpec(format="table", path=csv, options={"spec": "stroke"}, partition=out / "partition.json",
                    site="site-1")
    data = load_site_data(spec)
    assert data.n_train + data.n_val + data.n_test == manifest.sites[1].n


def test_same_seed_same_manifest(tmp_path: Path) -> None:
    """Re-running with the same arguments writes the same manifest."""
    csv = stroke_csv(tmp_path)
    args = ["-f", "table", "--path", str(csv), "-o", "spec=stroke", "--kind", "quantity_skew", "--sites", "4",
            "--alpha", "1", "--seed", "3"]
    assert invoke(*args, "--out", str(tmp_path / "a"))[0] == 0
    assert invoke(*args, "--out", str(tmp_path / "b"))[0] == 0
    assert (tmp_path / "a" / "partition.json").read_text() == (tmp_path / "b" / "partition.json").read_text()


def test_natural_and_feature_skew(tmp_path: Path) -> None:
    """Natural by a column (sites named after its values); feature skew on the auto-picked feature."""
    csv = stroke_csv(tmp_path)
    code, output = invoke("-f", "table", "--path", str(csv), "-o", "spec=stroke", "--kind", "natural",
                          "--column", "Residence_type", "--out", str(tmp_path / "nat"))
    assert code == 0, output
    assert [ln.split()[:2] for ln in output.splitlines()[1:3]] == [["rural", "20"], ["urban", "40"]]
    code, output = invoke("-f", "table", "--path", str(csv), "-o", "spec=stroke", "--kind", "feature_samples",
                          "--column", "auto_max", "--sites", "3", "--out", str(tmp_path / "feat"))
    assert code == 0, output
    manifest = json.loads((tmp_path / "feat" / "partition.json").read_text())
    assert manifest["spec"]["column"] in ("age", "avg_glucose_level", "bmi")
    assert manifest["source"]["column_rule"] == "auto_max"
    assert f"feature: {manifest['spec']['column']}" in output
    assert [s["n"] for s in manifest["sites"]] == [20, 20, 20]


def test_npz_multiclass_partition(tmp_path: Path) -> None:
    """MedMNIST-style files partition too (the table lists every class)."""
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", 30), ("val", 6), ("test", 9)):
        arrays[f"{split}_images"] = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, 4, (n, 1)).astype(np.uint8)
    np.savez(tmp_path / "m.npz", **arrays)
    npz = str(tmp_path / "m.npz")
    code, output = invoke("-f", "medmnist", "--path", npz, "-o", 'splits=["train", "val"]',
                          "--kind", "iid", "-k", "2", "--out", str(tmp_path / "o"))
    assert code == 0, output
    assert "2 sites, 36 of 36 items assigned" in output


def test_errors_are_one_clear_line(tmp_path: Path) -> None:
    """Missing parameters, an unknown column, a bad option: exit 2 with a message saying what to fix."""
    csv = stroke_csv(tmp_path)
    base = ["-f", "table", "--path", str(csv), "-o", "spec=stroke", "--out", str(tmp_path / "o")]
    code, output = invoke(*base, "--kind", "label_skew", "--sites", "3")
    assert code == 2 and "needs alpha" in output
    code, output = invoke(*base, "--kind", "natural", "--column", "hospital")
    assert code == 2 and "no site column 'hospital'" in output and "Residence_type" in output
    code, output = invoke("-f", "table", "--path", str(csv), "--kind", "iid", "-k", "2",
                          "--out", str(tmp_path))
    assert code == 2 and "spec" in output
    code, output = invoke(*base, "-o", "nonsense", "--kind", "iid", "--sites", "2")
    assert code != 0 and "KEY=VALUE" in output
    assert not (tmp_path / "o" / "partition.json").exists()


def test_help_lists_kinds_and_examples() -> None:
    """--help names every partition kind and shows examples."""
    code, output = invoke("--help")
    assert code == 0
    for word in ("label_skew", "quantity_skew", "feature_intervals", "feature_samples", "natural", "--cap"):
        assert word in output


STROKE_COLUMNS_TOML = """
label = "stroke"
numeric = ["age", "avg_glucose_level", "bmi"]
drop = ["id", "gender", "hypertension", "heart_disease", "ever_married", "work_type", "Residence_type",
        "smoking_status"]
"""


def test_specs_by_path(tmp_path: Path) -> None:
    """--spec FILE (feature spec), --data FILE (data spec) and --partition-spec FILE give the same manifest
    as the options typed out, and a site loads its part with the feature spec given by path."""
    # Prepare
    csv = stroke_csv(tmp_path)
    columns = tmp_path / "specs" / "columns.toml"
    columns.parent.mkdir()
    columns.write_text(STROKE_COLUMNS_TOML)
    (tmp_path / "specs" / "pooled.toml").write_text('format = "table"\npath = "../stroke.csv"\n'
                                                    'options = { spec = "columns.toml" }\n')
    (tmp_path / "specs" / "skew.toml").write_text('[partition]\nkind = "label_skew"\nn_sites = 3\nalpha = 0.5\n')
    # Execute
    typed = invoke("-f", "table", "--path", str(csv), "--spec", str(columns), "--kind", "label_skew",
                   "--sites", "3", "--alpha", "0.5", "--seed", "2", "--out", str(tmp_path / "typed"))
    files = invoke("--data", str(tmp_path / "specs" / "pooled.toml"), "--partition-spec",
                   str(tmp_path / "specs" / "skew.toml"), "--seed", "2", "--out", str(tmp_path / "files"))
    # Assert
    assert typed[0] == 0 and files[0] == 0, (typed, files)
    a, b = (json.loads((tmp_path / d / "partition.json").read_text()) for d in ("typed", "files"))
    assert a["sites"] == b["sites"] and a["spec"] == b["spec"] and a["spec"]["seed"] == 2
    assert a["source"]["options"]["spec"] == str(columns.resolve())
    data = load_site_data(DataSpec(format="table", path=csv, options={"spec": str(columns)},
                                   partition=tmp_path / "files" / "partition.json", site="site-0"))
    assert data.feature_names == ("age", "avg_glucose_level", "bmi")


def test_spec_files_missing_or_invalid_are_one_clear_line(tmp_path: Path) -> None:
    """A missing or invalid spec file: exit 2, naming the file and what is wrong."""
    csv = stroke_csv(tmp_path)
    bad = tmp_path / "bad.toml"
    bad.write_text('label = "stroke"\nnumeric = ["age"]\ncolour = "red"\n')
    base = ["-f", "table", "--path", str(csv), "--kind", "iid", "-k", "2", "--out", str(tmp_path / "o")]
    code, output = invoke(*base, "--spec", str(tmp_path / "nowhere.toml"))
    assert code == 2 and "nowhere.toml: FeatureSpec file not found" in output
    code, output = invoke(*base, "--spec", str(bad))
    assert code == 2 and "bad.toml: invalid FeatureSpec" in output and "colour" in output
    code, output = invoke(*base, "--spec", "diabetes")
    assert code == 2 and "unknown feature spec 'diabetes'" in output
    (tmp_path / "broken.toml").write_text("kind = \n")
    code, output = invoke("-f", "table", "--path", str(csv), "--spec", "stroke", "--partition-spec",
                          str(tmp_path / "broken.toml"), "--out", str(tmp_path / "o"))
    assert code == 2 and "broken.toml: not valid TOML" in output
    assert not (tmp_path / "o" / "partition.json").exists()


def test_length_of_stay_bins_are_printed_with_their_edges(tmp_path: Path) -> None:
    """A regression label's histogram keys are length-of-stay bins: the table says which days each holds."""
    rows = [f"{k},{20 + k},{[0.5, 1.5, 3, 9, 20][k % 5]}" for k in range(40)]
    csv = tmp_path / "los.csv"
    csv.write_text("id,age,los\n" + "\n".join(rows) + "\n")
    spec = tmp_path / "los.toml"
    spec.write_text('label = "los"\ntask = "regression"\nnumeric = ["age"]\ndrop = ["id"]\n')
    code, output = invoke("-f", "table", "--path", str(csv), "--spec", str(spec), "--kind", "iid", "-k", "2",
                          "--out", str(tmp_path / "o"))
    assert code == 0, output
    legend = next(line for line in output.splitlines() if line.startswith("bins"))
    assert legend == "bins (length of stay, days): 0: < 1, 1: [1, 2), 3: [3, 4), 8: [8, 14), 9: >= 14"
