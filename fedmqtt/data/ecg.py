"""12-lead WFDB ECG records (`.hea` + `.mat`/`.dat`) as fixed-length standardised signals, SNOMED-CT labels.

Layout: x float32 `(n, 12, length)`, leads in `LEADS` order, resampled to `fs` Hz (default 500), then the
first `length` samples kept (default 5000 = 10 s) or zeros appended; each lead of each record is
standardised by its own mean and std (computed before padding, so padding is the record's mean).
"""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedmqtt.data.base import TaskInfo
from fedmqtt.errors import DataError

LEADS: tuple[str, ...] = ("I", "II", "III", "aVR", "aVL", "aVF", "V1", "V2", "V3", "V4", "V5", "V6")
# The 26 scored classes of the PhysioNet/CinC Challenge 2021 (dx_mapping_scored.csv of
# physionetchallenges/evaluation-2021, in its order), each a group of codes scored as one diagnosis
# (docs/algorithms.md 17.4). Names join a group with "|" as the challenge's weights.csv does.
CINC2021_SCORED: tuple[tuple[str, ...], ...] = (
    ("164889003",), ("164890007",), ("6374002",), ("426627000",), ("733534002", "164909002"),
    ("713427006", "59118001"), ("270492004",), ("713426002",), ("39732003",), ("445118002",),
    ("251146004",), ("698252002",), ("426783006",), ("284470004", "63593006"), ("10370003",),
    ("365413008",), ("427172004", "17338001"), ("164947007",), ("111975006",), ("164917005",),
    ("47665007",), ("427393009",), ("426177001",), ("427084000",), ("164934002",), ("59931005",),
)  # fmt: skip
SINUS_RHYTHM = "426783006"


@dataclass(frozen=True)
class EcgHeader:
    """What this adapter needs from a `.hea` file."""

    record: str
    fs: float
    n_samples: int
    files: tuple[str, ...]  # per signal
    gains: tuple[float, ...]
    baselines: tuple[int, ...]
    leads: tuple[str, ...]
    dx: tuple[str, ...]
    age: float  # NaN when unknown


@dataclass(frozen=True)
class EcgSet:
    x: np.ndarray  # float32 (n, 12, length)
    y: np.ndarray  # float32 (n, n_labels) in {0, 1}
    records: tuple[str, ...]
    sources: np.ndarray  # record-name prefix (E = Georgia, HR = PTB-XL, JS = Chapman/Ningbo, ...)
    ages: np.ndarray  # float64, NaN when unknown
    task: TaskInfo
    unknown_codes: dict[str, int]  # codes not in the label list: ignored, counted here


def label_groups(labels: str | Sequence[str] = "cinc2021") -> tuple[tuple[str, ...], ...]:
    """'cinc2021' (the 26 scored classes) or a list of codes, each one code or equivalents joined by '|'."""
    if isinstance(labels, str):
        if labels != "cinc2021":
            raise DataError(f"unknown ECG label list {labels!r}; use 'cinc2021' or a list of SNOMED-CT codes")
        return CINC2021_SCORED
    groups = tuple(tuple(c.strip() for c in str(item).split("|")) for item in labels)
    codes = [c for g in groups for c in g]
    if not groups or any(not c.isdigit() for c in codes) or len(set(codes)) != len(codes):
        raise DataError(f"ECG labels must be distinct numeric SNOMED-CT codes, got {list(labels)}")
    return groups


def read_header(path: Path) -> EcgHeader:
    """Parse a WFDB header, tolerating the CinC 2021 quirks (record name 'E07500.mat', empty codes)."""
    path = Path(path)
    try:
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read WFDB header: {exc}") from exc
    body = [ln for ln in lines if ln and not ln.startswith("#")]
    comments = [ln.lstrip("#").strip() for ln in lines if ln.startswith("#")]
    rec = body[0].split() if body else []
    try:
        n_sig, fs, n_samples = int(rec[1]), float(rec[2].split("/")[0]), int(rec[3])
    except (IndexError, ValueError):
        raise DataError(f"{path}: line 1: malformed record line {body[:1]} "
                        "(expected: record n_sig fs n_samples)") from None
    if n_sig < 1 or len(body) < 1 + n_sig:
        raise DataError(f"{path}: header declares {n_sig} signals but has {len(body) - 1} signal lines")
    signals = [_signal_line(path, k, line) for k, line in enumerate(body[1 : 1 + n_sig], start=2)]
    return EcgHeader(
        record=re.sub(r"\.(mat|hea|dat)$", "", rec[0]), fs=fs, n_samples=n_samples,
        files=tuple(s[0] for s in signals), gains=tuple(s[1] for s in signals),
        baselines=tuple(s[2] for s in signals), leads=tuple(s[3] for s in signals),
        dx=_dx(path, comments), age=_age(comments),
    )


def _signal_line(path: Path, line_no: int, line: str) -> tuple[str, float, int, str]:
    """(file, gain, baseline, lead) of `file fmt gain(baseline)/units res zero init cksum block name`."""
    f = line.split()
    gain_field = f[2].split("/")[0] if len(f) > 2 else "200"
    match = re.fullmatch(r"([-+0-9.eE]+)(?:\(([-+0-9]+)\))?", gain_field)
    if len(f) < 2 or match is None:
        raise DataError(f"{path}: signal line {line_no}: malformed ({line!r})")
    try:
        gain = float(match[1]) or 200.0  # WFDB: gain 0 means the default 200
        baseline = int(match[2]) if match[2] else int(f[4]) if len(f) > 4 else 0  # default: the ADC zero
    except ValueError:
        raise DataError(f"{path}: signal line {line_no}: malformed ({line!r})") from None
    return f[0], gain, baseline, f[8] if len(f) > 8 else f"sig{line_no - 1}"


def _dx(path: Path, comments: list[str]) -> tuple[str, ...]:
    lines = [c for c in comments if c.lower().startswith("dx:")]
    if not lines:
        raise DataError(f"{path}: no '#Dx:' line (SNOMED-CT diagnosis codes)")
    codes = [c.strip() for c in lines[0][3:].split(",")]
    codes = [c for c in codes if c]  # the challenge data has empty codes ("...,427084000,,427172004")
    bad = [c for c in codes if not c.isdigit()]
    if bad:
        raise DataError(f"{path}: '#Dx:' line has a non-numeric SNOMED-CT code {bad[0]!r}")
    return tuple(codes)


def _age(comments: list[str]) -> float:
    for c in comments:
        if c.lower().startswith("age:"):
            try:
                return float(c[4:].strip())
            except ValueError:
                return math.nan  # "Unknown" or "NaN" in the challenge headers
    return math.nan


def read_signal(hea: Path, header: EcgHeader) -> np.ndarray:
    """Physical signal (12, n) in header units, leads reordered to `LEADS`."""
    names = {name.lower(): k for k, name in enumerate(header.leads)}
    order = [names.get(lead.lower()) for lead in LEADS]
    if len(header.leads) != 12 or None in order:
        raise DataError(f"{hea}: expected the 12 standard leads {list(LEADS)}, found {list(header.leads)}")
    signal_file = hea.parent / header.files[0]
    if signal_file.suffix.lower() == ".mat":
        digital = _read_mat(signal_file)
    else:
        digital = _read_wfdb(hea)
    if digital.shape != (12, header.n_samples):
        raise DataError(f"{signal_file}: signal shape {digital.shape}, header says (12, {header.n_samples})")
    gains = np.asarray(header.gains)[:, None]
    base = np.asarray(header.baselines)[:, None]
    return ((digital - base) / gains)[order]


def _read_mat(path: Path) -> np.ndarray:
    # The challenge's own loader (helper_code.py) reads `val` with scipy; wfdb.rdrecord rejects the Georgia
    # headers, whose record line names 'E07500.mat' instead of 'E07500'.
    from scipy.io import loadmat

    try:
        return np.asarray(loadmat(path)["val"], dtype=np.float64)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{path}: cannot read the 'val' array of the .mat signal file: {exc}") from exc


def _read_wfdb(hea: Path) -> np.ndarray:
    with warnings.catch_warnings():  # wfdb 4.3 uses pandas' deprecated inplace=True (a DeprecationWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            import wfdb
        except ImportError:
            raise DataError(f"{hea}: reading WFDB .dat records needs wfdb "
                            "(pip install 'fedmqtt[ecg]')") from None
        try:
            record = wfdb.rdrecord(str(hea.with_suffix("")), physical=False)
        except Exception as exc:  # wfdb raises many types (ValueError, HeaderSyntaxError, OSError)
            raise DataError(f"{hea}: wfdb cannot read the record: {exc}") from exc
    return np.asarray(record.d_signal, dtype=np.float64).T


def fix_length(signal: np.ndarray, fs: float, *, target_fs: int, length: int) -> np.ndarray:
    """Resample (polyphase) to target_fs, standardise each lead, keep the first `length` samples or pad 0."""
    if not math.isclose(fs, target_fs):
        from fractions import Fraction

        from scipy.signal import resample_poly

        ratio = Fraction(target_fs) / Fraction(fs).limit_denominator(1000)
        signal = resample_poly(signal, ratio.numerator, ratio.denominator, axis=1)
    mean = signal.mean(axis=1, keepdims=True)
    std = signal.std(axis=1, keepdims=True)
    signal = (signal - mean) / np.where(std > 0, std, 1.0)  # a flat lead stays 0 instead of dividing by 0
    out = np.zeros((signal.shape[0], length), dtype=np.float32)
    n = min(length, signal.shape[1])
    out[:, :n] = signal[:, :n]
    return out


def load_ecg_dir(path: Path, *, labels: str | Sequence[str] = "cinc2021", fs: int = 500,
                 length: int = 5000) -> EcgSet:
    """Every `*.hea` record of a folder (sorted by name) with its multi-label target over `labels`."""
    path = Path(path)
    headers = sorted(path.glob("*.hea")) if path.is_dir() else []
    if not headers:
        raise DataError(f"{path}: no WFDB records (*.hea) in this folder")
    groups = label_groups(labels)
    code_to_class = {code: k for k, group in enumerate(groups) for code in group}
    xs, ys, names, ages, unknown = [], [], [], [], Counter[str]()
    for hea in headers:
        header = read_header(hea)
        xs.append(fix_length(read_signal(hea, header), header.fs, target_fs=fs, length=length))
        target = np.zeros(len(groups), dtype=np.float32)
        for code in header.dx:
            if code in code_to_class:
                target[code_to_class[code]] = 1.0
            else:
                unknown[code] += 1
        ys.append(target)
        names.append(hea.stem)
        ages.append(header.age)
    sources = np.asarray([re.sub(r"[^A-Za-z].*$", "", n) or "unknown" for n in names], dtype=object)
    task = TaskInfo("multilabel", len(groups), tuple("|".join(g) for g in groups))
    return EcgSet(np.stack(xs), np.stack(ys), tuple(names), sources, np.asarray(ages, dtype=np.float64), task,
                  dict(sorted(unknown.items())))
