"""Data adapters on small generated files (tables, MedMNIST, WFDB, PhysioNet 2012), DataSpec and registry."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from fedmqtt.data.ecg import LEADS, fix_length, label_groups, load_ecg_dir
from fedmqtt.data.medmnist import load_medmnist
from fedmqtt.data.partitioners import PartitionSpec, label_histograms, partition, write_partition_manifest
from fedmqtt.data.physionet2012 import STATIC_NAMES, VARIABLES, load_physionet2012
from fedmqtt.data.registry import labels_digest, load_dataset, load_site_data
from fedmqtt.data.spec import DataSpec
from fedmqtt.data.splits import split_and_normalise
from fedmqtt.data.tables import STROKE_SPEC, FeatureSpec, load_table, resolve_spec
from fedmqtt.errors import DataError

Mutation = Callable[[str, list[str]], tuple[str, list[str]]]
STROKE_HEADER = ("id,gender,age,hypertension,heart_disease,ever_married,work_type,Residence_type,"
                 "avg_glucose_level,bmi,smoking_status,stroke")
STROKE_ROWS = [
    "9046,Male,67,0,1,Yes,Private,Urban,228.69,36.6,formerly smoked,1",
    "51676,Female,61,0,0,Yes,Self-employed,Rural,202.21,N/A,never smoked,1",
    "31112,Male,80,0,1,Yes,Private,Rural,105.92,32.5,never smoked,0",
    "60182,Female,49,0,0,Yes,Private,Urban,171.23,34.4,smokes,0",
    "1665,Other,0.08,1,0,No,children,Rural,174.12,24,Unknown,0",
]


def drop_field(row: str, k: int) -> str:
    fields = row.split(",")
    return ",".join(fields[:k] + fields[k + 1:])


def write_stroke(path: Path, rows: list[str] = STROKE_ROWS, header: str = STROKE_HEADER) -> Path:
    path.write_bytes(("\ufeff" + header + "\r\n" + "\r\n".join(rows)).encode("utf-8"))  # BOM + CRLF
    return path


# --- tables -----------------------------------------------------------------------------------------------


def test_stroke_spec_encodes_a_table(tmp_path: Path) -> None:
    """Numeric, binary, fixed one-hot columns; bmi N/A and smoking 'Unknown' are NaN; BOM/CRLF tolerated."""
    x, y, names = load_table(write_stroke(tmp_path / "s.csv"), STROKE_SPEC)
    assert x.shape == (5, 18) and x.dtype == np.float64 and y.tolist() == [1, 1, 0, 0, 0]
    row = dict(zip(names, x[0], strict=True))
    assert row["age"] == 67 and row["ever_married"] == 1 and row["Residence_type"] == 1
    assert row["gender_Male"] == 1 and row["gender_Female"] == 0
    assert row["smoking_status_formerly smoked"] == 1
    assert np.isnan(x[1, names.index("bmi")])
    smoking = [k for k, n in enumerate(names) if n.startswith("smoking_status_")]
    assert np.isnan(x[4, smoking]).all() and x[4, names.index("gender_Other")] == 1
    assert STROKE_SPEC.task_info().kind == "binary" and resolve_spec("stroke") is STROKE_SPEC


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda h, r: (h.replace(",bmi", ""), [drop_field(x, 9) for x in r]),
     "column 'bmi' of the feature spec is missing"),
    (lambda h, r: (h + ",hospital", [x + ",A" for x in r]), "column 'hospital' is not in the feature spec"),
    (lambda h, r: (h, [r[0].replace(",67,", ",sixty,")] + r[1:]),
     r"line 2, column 'age': not a number: 'sixty'"),
    (lambda h, r: (h, r[:2] + [r[2].replace("Private", "Pirate")] + r[3:]),
     r"line 4, column 'work_type': unknown category 'Pirate'"),
    (lambda h, r: (h, r[:1] + [r[1][:-1] + "2"] + r[2:]), r"line 3, column 'stroke': unknown label '2'"),
    (lambda h, r: (h, r[:1] + [r[1][:-1]] + r[2:]), r"line 3, column 'stroke': missing label"),
    (lambda h, r: (h, [r[0].replace(",Yes,", ",Maybe,")] + r[1:]),
     r"column 'ever_married': unknown value 'Maybe'"),
    (lambda h, r: (h, [r[0] + ",extra"] + r[1:]), "line 2: expected 12 fields, found 13"),
    (lambda h, r: (h, []), "no data rows"),
])  # fmt: skip
def test_table_errors_name_file_line_and_column(tmp_path: Path, mutate: Mutation, message: str) -> None:
    """A missing or undeclared column, a bad number, an unknown category or label: DataError naming where."""
    header, rows = mutate(STROKE_HEADER, list(STROKE_ROWS))
    path = write_stroke(tmp_path / "bad.csv", rows, header)
    with pytest.raises(DataError, match=message) as err:
        load_table(path, STROKE_SPEC)
    assert "bad.csv" in str(err.value)


def test_inline_spec_regression_and_multiclass(tmp_path: Path) -> None:
    """An inline spec (as from TOML): a regression label keeps NaN for missing; multiclass: class order."""
    path = tmp_path / "t.csv"
    path.write_text("site,x,y\nA,1,2.5\nB,2,\nA,3,4\n")
    spec = resolve_spec({"label": "y", "task": "regression", "numeric": ["x"], "drop": ["site"]})
    x, y, names = load_table(path, spec)
    assert names == ("x",) and y.dtype == np.float32 and np.isnan(y[1]) and y[2] == 4
    multi = FeatureSpec(label="y", task="multiclass", classes=("4", "2.5", "7"), numeric=("x",),
                        drop=("site",), missing=("",))
    with pytest.raises(DataError, match="missing label"):
        load_table(path, multi)
    with pytest.raises(ValidationError, match="exactly 2 classes"):
        FeatureSpec(label="y", classes=("a", "b", "c"))
    with pytest.raises(DataError, match="unknown table spec"):
        resolve_spec("diabetes")


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parquet is optional: without pyarrow the error says what to install."""
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"t.parquet: reading Parquet needs pyarrow"):
        load_table(tmp_path / "t.parquet", STROKE_SPEC)


# --- MedMNIST ---------------------------------------------------------------------------------------------


def write_npz(path: Path, colour: bool = True, **overrides: np.ndarray) -> Path:
    rng = np.random.default_rng(0)
    shape = (28, 28, 3) if colour else (28, 28)
    arrays = {}
    for split, n, top in (("train", 12, 3), ("val", 4, 3), ("test", 6, 5)):  # class 4 only in test
        arrays[f"{split}_images"] = rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)
        arrays[f"{split}_labels"] = (np.arange(n) % top).astype(np.uint8).reshape(n, 1)
    arrays.update(overrides)
    np.savez(path, **arrays)
    return path


def test_medmnist_pools_or_picks_splits(tmp_path: Path) -> None:
    """float32 (n, c, 28, 28) in [0, 1], int64 labels; the class count comes from the whole file."""
    path = write_npz(tmp_path / "blood.npz")
    x, y, task = load_medmnist(path)
    assert x.shape == (22, 3, 28, 28) and x.dtype == np.float32 and 0 <= x.min() and x.max() <= 1
    assert y.dtype == np.int64 and y.shape == (22,) and task.kind == "multiclass" and task.n_outputs == 5
    x_tr, y_tr, task_tr = load_medmnist(path, splits=["train"])
    assert x_tr.shape[0] == 12 and task_tr.n_outputs == 5  # picking train never shrinks the class count
    raw = np.load(path)["train_images"]
    assert np.allclose(x_tr[3, 1], raw[3, :, :, 1] / 255.0)
    grey, _, _ = load_medmnist(write_npz(tmp_path / "organ.npz", colour=False), splits=["val", "test"])
    assert grey.shape == (10, 1, 28, 28)


def test_medmnist_binary_and_multilabel(tmp_path: Path) -> None:
    """Two classes make a binary task; (n, k) labels a multilabel one."""
    two = {f"{s}_labels": np.array([[0], [1], [1], [0]][: n], dtype=np.uint8) for s, n in
           (("train", 12), ("val", 4), ("test", 6))}
    two = {k: np.resize(v, (n, 1)) for (k, v), n in zip(two.items(), (12, 4, 6), strict=True)}
    assert load_medmnist(write_npz(tmp_path / "pneu.npz", **two))[2].kind == "binary"
    multi = {f"{s}_labels": np.eye(3, dtype=np.uint8)[np.arange(n) % 3] for s, n in
             (("train", 12), ("val", 4), ("test", 6))}
    _, y, task = load_medmnist(write_npz(tmp_path / "chest.npz", **multi))
    assert task.kind == "multilabel" and task.n_outputs == 3 and y.dtype == np.float32 and y.shape == (22, 3)


def test_medmnist_errors_name_the_file(tmp_path: Path) -> None:
    """Missing keys, wrong dtype/shape, unknown split names and non-npz files: DataError naming the file."""
    path = write_npz(tmp_path / "m.npz")
    with pytest.raises(DataError, match="splits must be"):
        load_medmnist(path, splits=["training"])
    data = dict(np.load(path))
    del data["val_labels"]
    np.savez(tmp_path / "nokey.npz", **data)
    with pytest.raises(DataError, match=r"nokey.npz: no array 'val_labels'"):
        load_medmnist(tmp_path / "nokey.npz")
    with pytest.raises(DataError, match="dtype float64"):
        load_medmnist(write_npz(tmp_path / "f.npz", train_images=np.zeros((12, 28, 28, 3))))
    with pytest.raises(DataError, match="12 rows but"):
        load_medmnist(write_npz(tmp_path / "r.npz", train_images=np.zeros((5, 28, 28, 3), np.uint8)))
    (tmp_path / "junk.npz").write_text("not a zip")
    with pytest.raises(DataError, match="junk.npz: cannot read"):
        load_medmnist(tmp_path / "junk.npz")


# --- WFDB ECG ---------------------------------------------------------------------------------------------


def write_mat_record(folder: Path, name: str, dx: str, *, leads: tuple[str, ...] = LEADS, fs: int = 500,
                     n: int = 5000, record_line: str | None = None) -> np.ndarray:
    """A CinC-2021-style record written by hand: int16 `val` in a .mat, header naming 'NAME.mat'."""
    from scipy.io import savemat

    folder.mkdir(exist_ok=True)
    digital = (np.random.default_rng(len(name)).normal(0, 300, size=(len(leads), n))).astype(np.int16)
    savemat(folder / f"{name}.mat", {"val": digital}, format="4")
    lines = [record_line or f"{name}.mat {len(leads)} {fs} {n} 05-May-2020 09:49:17"]
    lines += [f"{name}.mat 16+24 1000/mV 16 0 0 0 0 {lead}" for lead in leads]
    lines += ["#Age: 61", "#Sex: Female", f"#Dx: {dx}", "#Rx: Unknown"]
    (folder / f"{name}.hea").write_text("\n".join(lines) + "\n")
    return digital / 1000.0


def test_wfdb_mat_records_multilabel_targets(tmp_path: Path) -> None:
    """Georgia-style headers read; scored codes map to their class (equivalents merged); others counted."""
    raw = write_mat_record(tmp_path / "ecg", "E00001", "59118001,426783006,,999999")
    write_mat_record(tmp_path / "ecg", "JS00002", "713427006,284470004")
    ecg = load_ecg_dir(tmp_path / "ecg")
    assert ecg.x.shape == (2, 12, 5000) and ecg.x.dtype == np.float32 and ecg.y.shape == (2, 26)
    names = ecg.task.label_names
    rbbb, sr = names.index("713427006|59118001"), names.index("426783006")
    pac = names.index("284470004|63593006")
    assert ecg.y[0, [rbbb, sr]].tolist() == [1, 1] and ecg.y[0].sum() == 2
    assert ecg.y[1, [rbbb, pac]].tolist() == [1, 1] and ecg.unknown_codes == {"999999": 1}
    assert ecg.sources.tolist() == ["E", "JS"] and ecg.ages.tolist() == [61, 61]
    expected = (raw[1] - raw[1].mean()) / raw[1].std()
    assert np.allclose(ecg.x[0, 1], expected, atol=1e-5)  # lead II, standardised per record


def test_wfdb_dat_record_written_by_wfdb_is_resampled(tmp_path: Path) -> None:
    """A .dat record (wfdb.wrsamp) at 250 Hz, leads in another order: resampled to 500 Hz, padded to 5000."""
    with warnings.catch_warnings():  # wfdb 4.3 + pandas 3 warn about inplace=True
        warnings.simplefilter("ignore", DeprecationWarning)
        wfdb = pytest.importorskip("wfdb")
        signal = np.sin(np.linspace(0, 20, 2000))[:, None] * np.arange(1, 13)[None, :]
        wfdb.wrsamp("R1", fs=250, units=["mV"] * 12, sig_name=list(reversed(LEADS)), p_signal=signal,
                    fmt=["16"] * 12, comments=["Age: 50", "Dx: 426783006"], write_dir=str(tmp_path))
    ecg = load_ecg_dir(tmp_path, labels=["426783006", "164889003"])
    assert ecg.x.shape == (1, 12, 5000) and ecg.y.tolist() == [[1.0, 0.0]]
    assert np.all(ecg.x[0, :, 4000:] == 0) and np.abs(ecg.x[0, :, :4000]).max() > 0.5  # 8 s of signal, then 0
    assert np.allclose(ecg.x[0, 0, :4000], ecg.x[0, 11, :4000], atol=1e-2)  # every lead the same shape


def test_fix_length_crops_and_label_lists() -> None:
    """Longer records keep their first `length` samples; label lists are validated."""
    x = np.arange(20, dtype=float)[None, :].repeat(12, axis=0)
    out = fix_length(x, 500, target_fs=500, length=10)
    assert out.shape == (12, 10) and np.allclose(out[0], ((x[0] - x[0].mean()) / x[0].std())[:10])
    assert label_groups(["1|2", "3"]) == (("1", "2"), ("3",))
    with pytest.raises(DataError, match="distinct numeric"):
        label_groups(["1", "1"])
    with pytest.raises(DataError, match="unknown ECG label list"):
        label_groups("cinc2020")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dx": "426783006,abc"}, "non-numeric SNOMED-CT code 'abc'"),
    ({"dx": "", "drop_dx": True}, r"no '#Dx:' line"),
    ({"dx": "426783006", "leads": LEADS[:11]}, "expected the 12 standard leads"),
    ({"dx": "426783006", "record_line": "E1.mat twelve 500 5000"}, "line 1: malformed record line"),
    ({"dx": "426783006", "record_line": "E1.mat 12 500 4000"}, r"signal shape \(12, 5000\), header says"),
])  # fmt: skip
def test_wfdb_malformed_headers_name_the_file(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    """A malformed header is a DataError naming the header file."""
    drop_dx = kwargs.pop("drop_dx", False)
    write_mat_record(tmp_path, "E1", **kwargs)
    if drop_dx:
        hea = tmp_path / "E1.hea"
        hea.write_text("\n".join(ln for ln in hea.read_text().splitlines() if not ln.startswith("#Dx")))
    with pytest.raises(DataError, match=message) as err:
        load_ecg_dir(tmp_path)
    assert "E1." in str(err.value)
    with pytest.raises(DataError, match="no WFDB records"):
        load_ecg_dir(tmp_path / "missing")


# --- PhysioNet 2012 ---------------------------------------------------------------------------------------

STAY_1 = """Time,Parameter,Value
00:00,RecordID,1001
00:00,Age,54
00:00,Gender,0
00:00,Height,-1
00:00,ICUType,4
00:00,Weight,-1
00:07,HR,73
00:40,HR,77
02:10,HR,90
02:15,Weight,0
03:00,Weight,80.5
47:59,Temp,37.5
48:00,Temp,38.0
"""
STAY_2 = """Time,Parameter,Value
00:00,RecordID,1000
00:00,Age,90
00:00,Gender,1
00:00,Height,170.2
00:00,ICUType,2
00:00,Weight,70
05:30,pH,7.4
"""
OUTCOMES = """RecordID,SAPS-I,SOFA,Length_of_stay,Survival,In-hospital_death
1000,6,1,5,-1,0
1001,16,8,-1,3,1
"""


def write_icu(root: Path, stays: tuple[str, ...] = (STAY_1, STAY_2), outcomes: str = OUTCOMES) -> Path:
    (root / "set-a").mkdir(parents=True)
    for k, text in enumerate(stays):
        (root / "set-a" / f"{k:06d}.txt").write_text(text)
    (root / "Outcomes-a.txt").write_text(outcomes)
    return root / "set-a"


def test_physionet_hourly_grid_static_and_outcomes(tmp_path: Path) -> None:
    """Last value per hour carried forward; 48:00 in the last hour; Weight 0 / -1 dropped; outcome -1 NaN."""
    icu = load_physionet2012(write_icu(tmp_path))
    assert icu.record_ids.tolist() == [1000, 1001] and icu.values.shape == (2, 48, 37)
    hr, temp, weight = (VARIABLES.index(v) for v in ("HR", "Temp", "Weight"))
    stay = icu.values[1]
    assert stay[0, hr] == 77 and stay[1, hr] == 77 and stay[2, hr] == 90 and stay[47, hr] == 90
    assert icu.observed[1, :, hr].sum() == 2 and stay[47, temp] == 38.0
    assert np.isnan(stay[:3, weight]).all() and stay[3, weight] == 80.5
    static = dict(zip(STATIC_NAMES, icu.static[1], strict=True))
    assert static["Age"] == 54 and static["Gender"] == 0
    assert np.isnan(static["Height"]) and np.isnan(static["Weight"])
    assert [static[f"ICUType_{t}"] for t in (1, 2, 3, 4)] == [0, 0, 0, 1] and icu.icu_type.tolist() == [2, 4]
    assert icu.death.tolist() == [0, 1] and icu.los[0] == 5 and np.isnan(icu.los[1])


def test_physionet_cache_outside_the_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second load comes from the .npz cache; a cache dir inside the dataset is refused."""
    import fedmqtt.data.physionet2012 as mod

    set_dir = write_icu(tmp_path / "data")
    first = load_physionet2012(set_dir, cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 1
    monkeypatch.setattr(mod, "_parse_all", lambda *a: pytest.fail("cache not used"))
    again = load_physionet2012(set_dir, cache_dir=tmp_path / "cache")
    assert np.array_equal(again.values, first.values, equal_nan=True)
    assert np.array_equal(again.death, first.death)
    with pytest.raises(DataError, match="inside the dataset folder"):
        load_physionet2012(set_dir, cache_dir=tmp_path / "data" / "cache")


@pytest.mark.parametrize(("stay", "outcomes", "message"), [
    (STAY_2.replace("Time,Parameter,Value", "Time;Parameter;Value"), OUTCOMES, "line 1: expected the header"),
    (STAY_2 + "06:00,Heartrate,80\n", OUTCOMES, "line 9, column Parameter: unknown parameter 'Heartrate'"),
    (STAY_2 + "6h,HR,80\n", OUTCOMES, "line 9, column Time: expected hh:mm"),
    (STAY_2 + "06:00,HR,fast\n", OUTCOMES, "line 9, column Value: not a number"),
    (STAY_2 + "06:00,HR\n", OUTCOMES, "line 9: expected 3 fields"),
    (STAY_2, OUTCOMES.replace("1000,", "1002,"), "Outcomes-a.txt: no outcome row for RecordID 1000"),
    (STAY_2, OUTCOMES.replace("5,-1,0", "5,-1,2"), "line 2, column In-hospital_death: unknown label 2"),
    (STAY_2, OUTCOMES.replace("Length_of_stay", "LOS"), "no column 'Length_of_stay'"),
])  # fmt: skip
def test_physionet_malformed_files_name_file_line_column(tmp_path: Path, stay: str, outcomes: str,
                                                         message: str) -> None:
    """Every malformed input is a DataError naming the file, the line and the column."""
    set_dir = write_icu(tmp_path, (stay,), outcomes)
    with pytest.raises(DataError, match=message):
        load_physionet2012(set_dir)


# --- DataSpec and the registry ----------------------------------------------------------------------------


def test_dataspec_validates_options_per_format(tmp_path: Path) -> None:
    """Options are checked when the spec is built; partition and site go together; relative paths resolve."""
    DataSpec(format="heart_disease", path=tmp_path / "f.data")
    with pytest.raises(ValidationError, match="spec"):
        DataSpec(format="table", path=tmp_path / "t.csv")
    with pytest.raises(ValidationError, match="target"):
        DataSpec(format="physionet2012", path=tmp_path, options={"target": "survival"})
    with pytest.raises(ValidationError, match="Extra inputs"):
        DataSpec(format="medmnist", path=tmp_path, options={"split": ["train"]})
    with pytest.raises(ValidationError, match="go together"):
        DataSpec(format="medmnist", path=tmp_path, partition=tmp_path / "p.json")
    spec = DataSpec(format="physionet2012", path=Path("set-a"), options={"cache_dir": "c"},
                    partition=Path("p.json"), site="1").resolved(tmp_path)
    assert spec.path == tmp_path / "set-a" and spec.partition == tmp_path / "p.json"
    assert spec.options["cache_dir"] == str(tmp_path / "c")


def test_registry_table_split_and_local_normalisation(tmp_path: Path) -> None:
    """Tables: stratified local split, train-median fill and train mean/std (train columns have mean 0)."""
    rows = [f"{k},{'Male' if k % 2 else 'Female'},{20 + k},0,0,Yes,Private,Urban,{100 + k},"
            f"{'N/A' if k % 7 == 0 else 25 + k % 5},smokes,{int(k % 3 == 0)}" for k in range(30)]
    data = load_site_data(DataSpec(format="table", path=write_stroke(tmp_path / "s.csv", rows),
                                   options={"spec": "stroke"}, split_seed=1))
    assert (data.n_train, data.n_val, data.n_test) == (18, 6, 6) and data.x_train.dtype == np.float32
    assert np.allclose(data.x_train.mean(axis=0), 0, atol=1e-6) and not np.isnan(data.x_test).any()
    assert data.task.kind == "binary" and data.label_histogram() == {"0": 12, "1": 6}


def test_registry_heart_disease_is_the_original_path() -> None:
    """heart_disease through the registry equals split_and_normalise bit for bit."""
    from fedmqtt.data.heart_disease import bundled_path, load_site_file

    path = bundled_path("hungary")
    via_registry = load_site_data(DataSpec(format="heart_disease", path=path, split_seed=3))
    direct = split_and_normalise(*load_site_file(path), seed=3)
    assert np.array_equal(via_registry.x_train, direct.x_train)
    assert np.array_equal(via_registry.y_test, direct.y_test)


def test_registry_images_ecg_icu_layouts(tmp_path: Path) -> None:
    """Images (n, c, h, w) per-channel standardised; ECG (n, 12, L); ICU (n, 48, 37 + 37 masks + 8 static)."""
    img = load_site_data(DataSpec(format="medmnist", path=write_npz(tmp_path / "b.npz")))
    assert img.x_train.shape[1:] == (3, 28, 28)
    assert np.allclose(img.x_train.mean(axis=(0, 2, 3)), 0, atol=1e-5)
    for k in range(5):
        write_mat_record(tmp_path / "ecg", f"E{k:05d}", "426783006" if k % 2 else "164889003")
    ecg = load_site_data(DataSpec(format="wfdb", path=tmp_path / "ecg", options={"length": 1000}))
    assert ecg.x_train.shape == (3, 12, 1000) and ecg.y_train.shape == (3, 26)
    assert ecg.task.kind == "multilabel"
    stays = tuple(STAY_2.replace("1000", str(1000 + k)).replace("05:30,pH,7.4", f"05:30,pH,{7 + k / 10}")
                  for k in range(6))
    rows = [f"{1000 + k},1,1,{k if k else -1},-1,0" for k in range(6)]  # stay 1000 has no length of stay
    outcomes = "\n".join([OUTCOMES.splitlines()[0], *rows])
    spec = DataSpec(format="physionet2012", path=write_icu(tmp_path / "icu", stays, outcomes),
                    options={"target": "los", "masks": True}, fractions=(0.4, 0.2, 0.4))
    icu = load_site_data(spec)
    assert icu.x_train.shape == (2, 48, 82) and icu.y_train.dtype == np.float32
    assert icu.task.kind == "regression"
    assert "dropped 1 unlabelled item(s)" in icu.notes and icu.n_train + icu.n_val + icu.n_test == 5
    masks = icu.x_train[:, :, 37:74]
    assert set(np.unique(masks).tolist()) <= {0.0, 1.0}  # mask channels are not standardised
    assert icu.feature_names[-1] == "ICUType_4" and not np.isnan(icu.x_test).any()


def test_registry_partition_selects_the_site_items(tmp_path: Path) -> None:
    """With a manifest the site keeps only its items; a manifest of other data is refused."""
    path = write_npz(tmp_path / "b.npz")
    dspec = DataSpec(format="medmnist", path=path)
    pooled = load_dataset(dspec)
    spec = PartitionSpec(kind="iid", n_sites=2, seed=0)
    parts = partition(spec, pooled.y)
    source = {"format": "medmnist", "path": str(path), "n_items": len(pooled),
              "labels_sha256": labels_digest(pooled.y)}
    write_partition_manifest(tmp_path / "p.json", spec, parts, label_histograms(pooled.y, parts), source)
    site = load_site_data(dspec.model_copy(update={"partition": tmp_path / "p.json", "site": "site-1"}))
    assert site.n_train + site.n_val + site.n_test == len(parts[1])
    assert any("site-1: 11 of 22 items" in note for note in site.notes)
    write_partition_manifest(tmp_path / "q.json", spec, parts, label_histograms(pooled.y, parts),
                             {**source, "n_items": 99})
    with pytest.raises(DataError, match="made from another dataset"):
        load_site_data(dspec.model_copy(update={"partition": tmp_path / "q.json", "site": "site-1"}))
    with pytest.raises(DataError, match="made from format 'medmnist'"):
        load_site_data(DataSpec(format="wfdb", path=tmp_path, partition=tmp_path / "p.json", site="site-0"))


# --- the real datasets in ../shared/datasets (skipped where absent) ---------------------------------------

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "datasets"


def shared(name: str, why: str) -> Path:
    folder = SHARED / name
    if not folder.is_dir():
        pytest.skip(f"needs ../shared/datasets/{name} ({why})")
    return folder


def test_real_stroke_table() -> None:
    """Kaggle stroke: 5110 rows, 249 strokes, bmi N/A 201, smoking Unknown 1544; a 60/20/20 local split."""
    path = shared("stroke", "not shipped: licence unclear") / "healthcare-dataset-stroke-data.csv"
    x, y, names = load_table(path, STROKE_SPEC)
    assert x.shape == (5110, 18) and int(y.sum()) == 249
    assert int(np.isnan(x[:, names.index("bmi")]).sum()) == 201
    assert int(np.isnan(x[:, names.index("smoking_status_smokes")]).sum()) == 1544
    assert int(x[:, names.index("gender_Other")].sum()) == 1
    data = load_site_data(DataSpec(format="table", path=path, options={"spec": "stroke"}))
    assert (data.n_train, data.n_val, data.n_test) == (3066, 1022, 1022)


def test_real_heart_disease_files_match_the_bundled_ones() -> None:
    """The shared UCI files are the ones bundled with the package."""
    from fedmqtt.data.heart_disease import SITE_FILES, SITES, bundled_path

    folder = shared("heart_disease", "the four UCI files")
    for site in SITES:
        assert (folder / SITE_FILES[site]).read_bytes() == bundled_path(site).read_bytes()


def test_real_medmnist_blood() -> None:
    """BloodMNIST: 11959 train images of 3x28x28, the documented class counts, 8 classes."""
    path = shared("medmnist", "MedMNIST .npz files") / "bloodmnist.npz"
    x, y, task = load_medmnist(path, splits=["train"])
    assert x.shape == (11959, 3, 28, 28) and task.kind == "multiclass" and task.n_outputs == 8
    assert np.bincount(y).tolist() == [852, 2181, 1085, 2026, 849, 993, 2330, 1643]


def test_real_medmnist_organ_grey() -> None:
    """OrganAMNIST: grey 1x28x28, 11 classes read from the whole file even when only val is picked."""
    x, y, task = load_medmnist(shared("medmnist", "MedMNIST .npz files") / "organamnist.npz", splits=["val"])
    assert x.shape == (6491, 1, 28, 28) and task.n_outputs == 11


def test_real_ecg_sample() -> None:
    """CinC 2021 sample: 50 records (20 Georgia, 10 PTB-XL, 20 Ningbo); scored labels as documented."""
    ecg = load_ecg_dir(shared("ecg", "CinC 2021 sample records") / "cinc2021_sample")
    assert ecg.x.shape == (50, 12, 5000) and np.isfinite(ecg.x).all()
    assert {s: int((ecg.sources == s).sum()) for s in ("E", "HR", "JS")} == {"E": 20, "HR": 10, "JS": 20}
    counts = dict(zip(ecg.task.label_names, ecg.y.sum(axis=0).astype(int).tolist(), strict=True))
    assert counts["284470004|63593006"] == 20 and counts["426783006"] == 15 and counts["427084000"] == 23
    assert sum(ecg.unknown_codes.values()) == 26 and "251238007" in ecg.unknown_codes


def test_real_physionet2012_subset(tmp_path: Path) -> None:
    """The first 200 set-a stays: (200, 48, 37), outcomes for each, ICU types 1-4, deaths as in Outcomes-a."""
    folder = shared("physionet2012", "PhysioNet 2012 set-a")
    icu = load_physionet2012(folder / "set-a", limit=200, cache_dir=tmp_path)
    assert icu.values.shape == (200, 48, 37) and set(icu.icu_type.tolist()) <= {1, 2, 3, 4}
    rows = [ln.split(",") for ln in (folder / "Outcomes-a.txt").read_text().splitlines()[1:]]
    death = {int(r[0]): int(r[5]) for r in rows}
    assert icu.death.tolist() == [death[int(r)] for r in icu.record_ids]
    assert 0.05 < icu.observed.mean() < 0.5
