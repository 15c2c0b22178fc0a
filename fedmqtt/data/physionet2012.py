"""PhysioNet/CinC 2012 ICU stays (set-a files) as hourly 48-step sequences, static features and outcomes."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from fedmqtt.data.plausible import Range, RemovedCounts, outside
from fedmqtt.errors import DataError

# The 37 time-series variables of the challenge (Weight is also a static descriptor), in a fixed order.
VARIABLES: tuple[str, ...] = (
    "ALP", "ALT", "AST", "Albumin", "BUN", "Bilirubin", "Cholesterol", "Creatinine", "DiasABP", "FiO2",
    "GCS", "Glucose", "HCO3", "HCT", "HR", "K", "Lactate", "MAP", "MechVent", "Mg", "NIDiasABP", "NIMAP",
    "NISysABP", "Na", "PaCO2", "PaO2", "Platelets", "RespRate", "SaO2", "SysABP", "Temp", "TroponinI",
    "TroponinT", "Urine", "WBC", "Weight", "pH",
)  # fmt: skip
DESCRIPTORS: tuple[str, ...] = ("RecordID", "Age", "Gender", "Height", "ICUType", "Weight")
ICU_TYPES: tuple[int, ...] = (1, 2, 3, 4)  # coronary care, cardiac surgery recovery, medical, surgical
# Static features: Gender 1 = male; ICUType one-hot over the fixed codebook.
STATIC_NAMES: tuple[str, ...] = ("Age", "Gender", "Height", "Weight", *(f"ICUType_{t}" for t in ICU_TYPES))
HOURS = 48
# Columns a plausible range may name: the time series and the numeric static descriptors.
RANGED_COLUMNS: tuple[str, ...] = (*VARIABLES, "Age", "Height")
OUTCOME_COLUMNS = ("RecordID", "SAPS-I", "SOFA", "Length_of_stay", "Survival", "In-hospital_death")
_VAR = {name: k for k, name in enumerate(VARIABLES)}
_CACHE_VERSION = "1"
_TIMES: dict[str, int] = {}  # "hh:mm" -> minutes since admission


@dataclass(frozen=True)
class IcuSet:
    """Stays sorted by RecordID.

    values: float32 (n, 48, 37), the last value of each hour carried forward within the stay, NaN before
    a variable's first measurement; observed: bool (n, 48, 37), measured in that hour; static: float64
    (n, 8), NaN where unknown; death: float64 (n,) 0/1; los: float64 (n,) days; NaN = missing outcome.
    """

    record_ids: np.ndarray
    values: np.ndarray
    observed: np.ndarray
    static: np.ndarray
    icu_type: np.ndarray  # int64, 0 when unknown (the natural site key)
    death: np.ndarray
    los: np.ndarray


def load_physionet2012(set_dir: Path, *, outcomes: Path | None = None, limit: int | None = None,
                       cache_dir: Path | None = None) -> IcuSet:
    """Read every `NNNNNN.txt` stay of `set_dir` (the first `limit` by name) and their outcomes.

    Args:
        set_dir: a folder like `set-a/` of per-stay CSV files `Time,Parameter,Value` (Time hh:mm).
        outcomes: `Outcomes-a.txt`; default: `Outcomes-<x>.txt` beside `set-<x>/`.
        cache_dir: where to keep a parsed copy (`.npz`, keyed by the files' names, sizes and mtimes);
            it must not be inside the dataset folder, which stays read-only.

    Raises:
        DataError: a malformed file (naming file, line and column), an unknown parameter, a stay without
            an outcome row, or a cache dir inside the dataset.
    """
    set_dir = Path(set_dir)
    outcomes = Path(outcomes) if outcomes is not None else _default_outcomes(set_dir)
    files = _stay_files(set_dir, limit)
    cache = _cache_path(cache_dir, set_dir, files, outcomes)
    if cache is not None and cache.exists():
        with np.load(cache, allow_pickle=False) as npz:
            return IcuSet(**{key: npz[key] for key in npz.files})
    icu = _parse_all(files, outcomes)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(cache.stem + ".tmp.npz")
        np.savez_compressed(tmp, **icu.__dict__)
        tmp.replace(cache)
    return icu


def without_implausible(icu: IcuSet, ranges: Mapping[str, Range]) -> tuple[IcuSet, RemovedCounts]:
    """`icu` with every measurement outside its variable's range removed, as if never taken, and per stay
    the number removed per variable (hours of the time series; 1 for a static descriptor).

    A removed measurement leaves its hour unobserved, so the last plausible value before it is carried
    forward instead (the mask channels say "not observed" there too). A range on Weight applies to the
    static descriptor and to the measurements alike.
    """
    values, observed, static = icu.values.copy(), icu.observed.copy(), icu.static.copy()
    removed: RemovedCounts = {}
    for name, bounds in ranges.items():
        count = np.zeros(len(icu.record_ids), dtype=np.int32)
        if name in _VAR:
            k = _VAR[name]
            bad = observed[:, :, k] & outside(values[:, :, k], bounds)
            observed[:, :, k] &= ~bad
            count += bad.sum(axis=1, dtype=np.int32)
        if name in STATIC_NAMES:
            k = STATIC_NAMES.index(name)
            bad_static = outside(static[:, k], bounds)
            static[:, k] = np.where(bad_static, np.nan, static[:, k])
            count += bad_static.astype(np.int32)
        if count.any():
            removed[name] = count
    if removed:
        values = np.where(observed, values, np.nan).astype(values.dtype)  # the measurements as taken
        _carry_forward(values, observed)
    return replace(icu, values=values, observed=observed, static=static), removed


def cache_file(set_dir: Path, *, outcomes: Path | None = None, limit: int | None = None,
               cache_dir: Path | None = None) -> Path | None:
    """The parsed copy `load_physionet2012` keeps for these arguments (None without a cache dir); its name
    changes whenever a stay file or the outcomes change (names, sizes, mtimes)."""
    set_dir = Path(set_dir)
    outcomes = Path(outcomes) if outcomes is not None else _default_outcomes(set_dir)
    return _cache_path(cache_dir, set_dir, _stay_files(set_dir, limit), outcomes)


def _stay_files(set_dir: Path, limit: int | None) -> list[Path]:
    files = sorted(set_dir.glob("*.txt")) if set_dir.is_dir() else []
    if not files:
        raise DataError(f"{set_dir}: no per-stay files (*.txt) in this folder")
    return files[:limit] if limit is not None else files


def _default_outcomes(set_dir: Path) -> Path:
    suffix = set_dir.name.split("-", 1)[1] if "-" in set_dir.name else "a"
    return set_dir.parent / f"Outcomes-{suffix}.txt"


def _cache_path(cache_dir: Path | None, set_dir: Path, files: list[Path], outcomes: Path) -> Path | None:
    if cache_dir is None:
        return None
    cache_dir, data_root = Path(cache_dir).resolve(), set_dir.resolve().parent
    if cache_dir == data_root or data_root in cache_dir.parents:
        raise DataError(f"cache dir {cache_dir} is inside the dataset folder {data_root}; "
                        "pick one outside it")
    key = hashlib.sha256(_CACHE_VERSION.encode())
    real_dir = set_dir.resolve()
    for f in (*files, outcomes):
        st = f.stat()
        # The stays are the folder's own files: resolving the folder once names them as resolving each
        # would (a symlinked stay file aside), at a fraction of the cost for 4000 files.
        real = real_dir / f.name if f.parent == set_dir and not f.is_symlink() else f.resolve()
        key.update(f"{real}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return cache_dir / f"physionet2012-{set_dir.name}-{len(files)}-{key.hexdigest()[:16]}.npz"


def _parse_all(files: list[Path], outcomes_path: Path) -> IcuSet:
    n = len(files)
    values: np.ndarray = np.full((n, HOURS, len(VARIABLES)), np.nan, dtype=np.float32)
    observed: np.ndarray = np.zeros((n, HOURS, len(VARIABLES)), dtype=bool)
    static: np.ndarray = np.full((n, len(STATIC_NAMES)), np.nan)
    icu_type: np.ndarray = np.zeros(n, dtype=np.int64)
    ids: np.ndarray = np.zeros(n, dtype=np.int64)
    for i, path in enumerate(files):
        ids[i], static[i], icu_type[i] = _parse_stay(path, values[i], observed[i])
    order = np.argsort(ids, kind="stable")  # RecordID order, whatever the file names
    ids, values, observed, static, icu_type = (a[order] for a in (ids, values, observed, static, icu_type))
    _carry_forward(values, observed)
    outcome = _read_outcomes(outcomes_path)
    missing = [int(r) for r in ids if int(r) not in outcome]
    if missing:
        raise DataError(f"{outcomes_path}: no outcome row for RecordID {missing[0]} "
                        f"({len(missing)} stays lack one)")
    death = np.asarray([outcome[int(r)][0] for r in ids])
    los = np.asarray([outcome[int(r)][1] for r in ids])
    return IcuSet(ids, values, observed, static, icu_type, death, los)


def _parse_stay(path: Path, values: np.ndarray, observed: np.ndarray) -> tuple[int, np.ndarray, int]:
    """Fill one stay's (48, 37) hourly grid in place (the last value of an hour wins); return descriptors."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read ICU stay: {exc}") from exc
    if not lines or lines[0].strip() != "Time,Parameter,Value":
        raise DataError(f"{path}: line 1: expected the header 'Time,Parameter,Value', got {lines[:1]}")
    desc: dict[str, float] = {}
    for line_no, line in enumerate(lines[1:], start=2):
        if not line:
            continue
        fields = line.split(",")
        if len(fields) != 3:
            raise DataError(f"{path}: line {line_no}: expected 3 fields (Time,Parameter,Value), "
                            f"found {len(fields)}")
        minutes = _TIMES.get(fields[0])
        if minutes is None:  # few distinct times recur in 1.7M rows: parse each once
            minutes = _TIMES.setdefault(fields[0], _minutes(path, line_no, fields[0]))
        name, value = fields[1], _number(path, line_no, fields[2])
        if minutes == 0 and name in DESCRIPTORS and name not in desc:
            desc[name] = value  # the 00:00 descriptor block; a later Weight is a measurement
            continue
        var = _VAR.get(name)
        if var is None:
            raise DataError(f"{path}: line {line_no}, column Parameter: unknown parameter {name!r}")
        if value < 0 or (value == 0 and name == "Weight"):
            continue  # -1 marks unknown; 0 kg means not measured (PROVENANCE: 184 such rows)
        hour = minutes // 60 if minutes < 60 * HOURS else HOURS - 1  # 48:00 belongs to the last hour
        values[hour, var] = value
        observed[hour, var] = True
    if "RecordID" not in desc:
        raise DataError(f"{path}: no RecordID descriptor at 00:00")
    icu = desc.get("ICUType", 0.0)
    return int(desc["RecordID"]), _static(desc), int(icu) if icu in ICU_TYPES else 0


def _static(desc: dict[str, float]) -> np.ndarray:
    def known(name: str, positive: bool = True) -> float:
        v = desc.get(name, -1.0)
        return math.nan if v < 0 or (positive and v == 0) else v

    icu = desc.get("ICUType", -1.0)
    one_hot = [math.nan] * len(ICU_TYPES) if icu not in ICU_TYPES else [float(icu == t) for t in ICU_TYPES]
    gender = desc.get("Gender", -1.0)
    return np.asarray([known("Age"), gender if gender in (0.0, 1.0) else math.nan, known("Height"),
                       known("Weight"), *one_hot])


def _minutes(path: Path, line_no: int, text: str) -> int:
    hh, _, mm = text.partition(":")
    if not (hh.isdigit() and mm.isdigit() and len(mm) == 2 and int(mm) < 60):
        raise DataError(f"{path}: line {line_no}, column Time: expected hh:mm, got {text!r}")
    return int(hh) * 60 + int(mm)


def _number(path: Path, line_no: int, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise DataError(f"{path}: line {line_no}, column Value: not a number: {text!r}") from None
    if value != value or value in (math.inf, -math.inf):
        raise DataError(f"{path}: line {line_no}, column Value: not a finite number: {text!r}")
    return value


def _carry_forward(values: np.ndarray, observed: np.ndarray) -> None:
    """Last observation carried forward along the hours, within each stay and variable (in place)."""
    hours = np.arange(HOURS)[None, :, None]
    last = np.maximum.accumulate(np.where(observed, hours, -1), axis=1)
    filled = np.take_along_axis(values, np.maximum(last, 0), axis=1)
    values[...] = np.where(last >= 0, filled, np.nan)


def _read_outcomes(path: Path) -> dict[int, tuple[float, float]]:
    """RecordID -> (in-hospital death 0/1, length of stay in days); -1 (missing) becomes NaN."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read outcomes: {exc}") from exc
    header = [h.strip() for h in lines[0].split(",")] if lines else []
    for name in OUTCOME_COLUMNS:
        if name not in header:
            raise DataError(f"{path}: line 1: no column {name!r}; expected {list(OUTCOME_COLUMNS)}")
    col = {name: header.index(name) for name in OUTCOME_COLUMNS}
    out: dict[int, tuple[float, float]] = {}
    for line_no, line in enumerate(lines[1:], start=2):
        fields = line.split(",")
        if len(fields) != len(header):
            raise DataError(f"{path}: line {line_no}: expected {len(header)} fields, found {len(fields)}")
        cell = {name: _outcome_number(path, line_no, name, fields[col[name]]) for name in OUTCOME_COLUMNS}
        death, los = cell["In-hospital_death"], cell["Length_of_stay"]
        if death not in (0.0, 1.0, -1.0):
            raise DataError(f"{path}: line {line_no}, column In-hospital_death: unknown label {death:g} "
                            "(expected 0, 1 or -1)")
        out[int(cell["RecordID"])] = (math.nan if death < 0 else death, math.nan if los < 0 else los)
    return out


def _outcome_number(path: Path, line_no: int, column: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise DataError(f"{path}: line {line_no}, column {column}: not a number: {text!r}") from None
