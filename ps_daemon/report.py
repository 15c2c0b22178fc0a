"""Build the run report (JSON-able dict and Markdown) from the final state. Pure."""

from __future__ import annotations

import dataclasses
from typing import Any

from fedmqtt.means import mean_defined
from ps_daemon.config import DaemonConfig
from ps_daemon.participant_spent import spent_after
from ps_daemon.state import DaemonState

SPLITS = ("val", "test")


def build_report(config: DaemonConfig, state: DaemonState, *, timings: dict[str, float],
                 traffic: dict[str, Any], models: dict[str, str],
                 usage: dict[int, dict[str, dict[str, Any]]] | None = None,
                 privacy: dict[str, dict[str, Any]] | None = None,
                 init_model: dict[str, Any] | None = None) -> dict[str, Any]:
    """`init_model`: what a pretrained starting model loaded and kept (ps_daemon.model_init.init_record)."""
    per_site: dict[str, Any] = {}
    for site in config.sorted_sites:
        rep = state.final_reports.get(site)
        if rep is None and state.recruited is not None and site not in state.recruited:
            rank = next((r for r in (state.recruitment or {}).get("ranking", []) if r["site"] == site), None)
            why = f"not recruited (score {rank['score']:.4f}, rank {rank['rank']})" if rank else "not recruited"
            per_site[site] = {"missing": why}
            continue
        if rep is None:
            per_site[site] = {"missing": "no final report (site offline or past the deadline)"}
            continue
        per_site[site] = {"metrics": {k: dict(v) for k, v in rep.metrics.items() if k in SPLITS},
                          "n_samples": dict(rep.n_samples),
                          "undefined": {k: v for k, v in rep.undefined.items() if not k.startswith("best.")}}
    mean = _means(state.final_reports.values(), prefix="")
    best = state.best
    return {
        "run_id": config.run_id,
        "algorithm": config.algorithm,
        "config": config.model_dump(mode="json", exclude={"credentials"}),
        "rounds": [dataclasses.asdict(r) | {"duration_s": r.closed_at - r.started_at} for r in state.history],
        "final": {"model_hash": state.model_hash, "per_site": per_site, "mean": mean},
        "best_round": None if best is None else {"round": best.round, "score": best.score,
                                                 "metric": f"val {config.selection_metric}",
                                                 "model_hash": best.model_hash},
        "best": _best_section(state),
        "recruitment": None if state.recruitment is None else dict(state.recruitment),
        "manifest": run_manifest(state),
        "timings": timings,
        "traffic": traffic,
        "models": models,
        "init_model": init_model,
        "usage": usage_section(usage or {}),
        # Record-level DP (docs/privacy.md): each site's epsilon as it reported it with its newest accepted update,
        # over everything its records ever served. Participant-level DP (DP-FedAvg): what the released models had
        # cost after each round and at the end (None without it); each round's "server" has the rule's diagnostics.
        "privacy": {"record_level": dict(sorted((privacy or {}).items())),
                    "participant_level": participant_section(state)},
        # Secure aggregation (docs/secure-aggregation.md): the PS saw only the sums; per round who was in the sum,
        # who was left out and whose masks were removed with rebuilt keys (each round's "secure" has the names).
        "secure_aggregation": {"enabled": config.secure_aggregation.enabled, "per_round": [
            {"round": r.round, "included": len(r.secure.get("included", ())), "dropped": len(r.secure.get(
                "dropped", ())), "recovered": len(r.secure.get("recovered", ())), "tries": r.secure.get("tries", 1),
             "clipped": len(r.secure.get("clipped", ()))}
            for r in state.history if r.secure]},
    }


def participant_section(state: DaemonState) -> dict[str, Any] | None:
    """Participant-level DP per round (epsilon at delta after it, accountant, releases charged) and the final
    spending; None when the run released its models without it."""
    per_round = [spent.model_dump() for r in state.history if (spent := spent_after(r)) is not None]
    if not per_round:
        return None
    return {"per_round": per_round, "final": per_round[-1]}


def usage_section(usage: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per round and site what local training cost (ResourceUsage), and each site's totals."""
    rounds: dict[str, int] = {}
    sums: dict[str, dict[str, float | None]] = {}  # None once a round lacks the counter
    for per_site in usage.values():
        for site, u in per_site.items():
            rounds[site] = rounds.get(site, 0) + 1
            s = sums.setdefault(site, {"wall_s": 0.0, "cpu_s": 0.0, "energy_j": 0.0})
            for key in ("wall_s", "cpu_s", "energy_j"):
                so_far, more = s[key], u.get(key)
                s[key] = None if so_far is None or more is None else so_far + more
    totals = {site: {"rounds": rounds[site], **s} for site, s in sums.items()}
    return {"per_round": {str(r): usage[r] for r in sorted(usage)}, "per_site_total": totals}


def run_manifest(state: DaemonState) -> dict[str, Any]:
    """What makes the run reproducible and auditable: library versions and every model version exchanged."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    versions: dict[str, str] = {"python": platform.python_version()}
    for package in ("fedmqtt", "numpy", "torch", "paho-mqtt", "msgpack", "pydantic", "scikit-learn"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = "not installed"
    hashes = {str(r.round): r.model_hash for r in state.history}
    hashes[str(state.round)] = state.model_hash  # the final model
    return {"versions": versions, "model_hashes": hashes,
            "best_model_hash": state.best.model_hash if state.best else None}


def _means(reports: Any, *, prefix: str) -> dict[str, dict[str, float | None]]:
    """Unweighted means over sites, per split, of the metrics under `prefix + split`."""
    reports = list(reports)
    mean: dict[str, dict[str, float | None]] = {}
    for split in SPLITS:
        key = prefix + split
        names = sorted({k for r in reports for k in r.metrics.get(key, {})})
        mean[split] = {k: mean_defined([r.metrics.get(key, {}).get(k) for r in reports]) for k in names}
    return mean


def _best_section(state: DaemonState) -> dict[str, Any] | None:
    """Hwang et al.'s reported numbers: each site's best-validation-round model on its test split (17.1)."""
    reports = {s: r for s, r in state.final_reports.items() if any(k.startswith("best.") for k in r.metrics)}
    if state.best is None or not reports:
        return None
    per_site = {s: {"metrics": {split: dict(r.metrics.get(f"best.{split}", {})) for split in SPLITS},
                    "n_samples": dict(r.n_samples), "best_round": r.best_round,
                    "undefined": {k[5:]: v for k, v in r.undefined.items() if k.startswith("best.")}}
                for s, r in sorted(reports.items())}
    return {"round": state.best.round, "per_site": per_site, "mean": _means(reports.values(), prefix="best.")}


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


# Which metrics a table shows, by what the sites reported: only those that apply to the task.
CLASSIFICATION_COLUMNS = ("auroc", "accuracy")
REGRESSION_COLUMNS = ("mae", "mse", "msle")
# More sites than this: report.md shows summary statistics; every site is in per_site.csv.
MAX_SITE_ROWS = 30


def report_metrics(report: dict[str, Any]) -> tuple[str, ...]:
    """The metrics of this run's task: AUROC/accuracy for classification, MAE/MSE/MSLE for regression."""
    seen = set(report["final"]["mean"].get("test", {})) | set(report["final"]["mean"].get("val", {}))
    for r in report.get("rounds", []):
        seen |= set(r.get("mean", {}))
    if seen & {"mae", "mse"} and not seen & {"auroc", "accuracy"}:
        return REGRESSION_COLUMNS
    return CLASSIFICATION_COLUMNS


def final_table(report: dict[str, Any], metrics: tuple[str, ...] | None = None) -> list[list[str]]:
    """Rows of per-site test metrics, then the mean; 'n/a' with the reason where undefined.

    `metrics` None: those of the run's task (`report_metrics`). A report with baselines (see
    fedmqtt.baseline_report) gets a last row per baseline with its mean, to compare the model against.
    """
    metrics = report_metrics(report) if metrics is None else metrics
    rows = [["site", "n_test", *[f"test {m}" for m in metrics], "note"]]
    for site, entry in report["final"]["per_site"].items():
        if "missing" in entry:
            rows.append([site, "-", *["n/a"] * len(metrics), entry["missing"]])
            continue
        test = entry["metrics"].get("test", {})
        notes = [f"{k.split('.', 1)[-1]}: {v}" for k, v in entry["undefined"].items()
                 if k.startswith("test.") and k.split(".", 1)[1] in metrics]
        rows.append([site, str(entry["n_samples"].get("test", "-")), *[_fmt(test.get(m)) for m in metrics],
                     "; ".join(notes)])
    mean = report["final"]["mean"].get("test", {})
    rows.append(["mean", "", *[_fmt(mean.get(m)) for m in metrics], "unweighted, over sites where defined"])
    for base in baseline_rows(report):
        rows.append([base.label, "", *[base.cell(m) for m in metrics], base.note])
    return rows


# A constant scores the same on these whatever its value (fedmqtt.baselines.RANKING_METRICS).
_RANKING = frozenset({"auroc", "auprc", "balanced_accuracy"})


@dataclasses.dataclass(frozen=True)
class BaselineRow:
    """One baseline's mean test metrics over sites, as the report's tables show it."""

    label: str
    test: dict[str, float | None]
    note: str
    constant: bool  # a constant per site: ranking metrics are 0.5 by construction, not a score

    def cell(self, metric: str) -> str:
        return "0.5 (constant)" if self.constant and metric in _RANKING else _fmt(self.test.get(metric))


def baseline_rows(report: dict[str, Any]) -> list[BaselineRow]:
    """Every baseline the report holds: `baselines` (simulations: each metric-optimal constant, the pooled
    reference model, the site alone), else the single `baseline` older reports had."""
    section = report.get("baselines")
    if not section:
        old = report.get("baseline")
        return [BaselineRow("baseline mean", old["mean"].get("test", {}), old["what"], True)] if old else []
    rows = [BaselineRow(f"constant for {c['name']}", c["mean"]["test"], c["what"], True)
            for c in section.get("constants", [])]
    reference = section.get("pooled_reference") or {}
    if reference.get("fitted"):
        rows.append(BaselineRow("pooled reference", reference["mean"]["test"], reference["what"], False))
    if alone := section.get("site_alone"):
        rows.append(BaselineRow("site alone", alone["mean"]["test"], alone["what"], True))
    return rows


def baseline_warnings(report: dict[str, Any]) -> list[str]:
    """Where the model does not beat a constant, or the partition leaks the label (fedmqtt.baseline_report)."""
    return list((report.get("baselines") or {}).get("warnings", []))


def summary_table(report: dict[str, Any], metrics: tuple[str, ...] | None = None) -> list[list[str]]:
    """For many sites: per test metric the number of sites where defined, mean, median, min and max, then
    the mean of the constant optimal for that metric, of the pooled reference and of the site alone."""
    import numpy as np

    metrics = report_metrics(report) if metrics is None else metrics
    entries = report["final"]["per_site"].values()
    missing = sum(1 for e in entries if "missing" in e)
    section = report.get("baselines")
    bases = baseline_rows(report)
    by_label = {b.label: b for b in bases}
    # The metric-optimal constant of each metric (the constants' rows come first, in the section's order).
    constants = (section or {}).get("constants", [])
    constant_for = {m: b for b, c in zip(bases[:len(constants)], constants, strict=True) for m in c["metrics"]}
    heads = ["best constant", "pooled reference", "site alone"] if section else [b.label for b in bases]
    rows = [["test metric", "sites", "mean", "median", "min", "max", *heads]]
    for m in metrics:
        values = [e["metrics"].get("test", {}).get(m) for e in entries if "missing" not in e]
        v = np.array([x for x in values if x is not None], dtype=np.float64)
        stats = [_fmt(float(f(v))) if v.size else "n/a" for f in (np.mean, np.median, np.min, np.max)]
        if section:
            best = "0.5 (constant)" if m in _RANKING else constant_for[m].cell(m) if m in constant_for else "n/a"
            others = [by_label[k].cell(m) if k in by_label else "n/a" for k in ("pooled reference", "site alone")]
            cells = [best, *others]
        else:
            cells = [b.cell(m) for b in bases]
        rows.append([m, f"{v.size} of {len(values) + missing}", *stats, *cells])
    return rows


def per_site_csv(report: dict[str, Any]) -> str:
    """Every site's final val/test metrics, sample counts and why a value is missing, as CSV."""
    import csv
    import io

    names = sorted({k for e in report["final"]["per_site"].values() for split in SPLITS
                    for k in e.get("metrics", {}).get(split, {})})
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["site", "n_val", "n_test", *[f"{split} {m}" for split in SPLITS for m in names], "note"])
    for site, e in report["final"]["per_site"].items():
        if "missing" in e:
            writer.writerow([site, "", "", *[""] * (2 * len(names)), e["missing"]])
            continue
        cells = [e["metrics"].get(split, {}).get(m) for split in SPLITS for m in names]
        notes = "; ".join(f"{k}: {v}" for k, v in sorted(e.get("undefined", {}).items()))
        writer.writerow([site, e["n_samples"].get("val", ""), e["n_samples"].get("test", ""),
                         *["" if c is None else repr(float(c)) for c in cells], notes])
    return out.getvalue()


def render_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _md_table(rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0]),
            *("| " + " | ".join(r) + " |" for r in rows[1:])]


def _baseline_notes(report: dict[str, Any]) -> list[str]:
    """What the baseline rows are, and a warning line per metric the model does not win on."""
    section = report.get("baselines")
    if not section:
        old = report.get("baseline")
        return ["", f"Baseline: {old['what']}. A model no better than it has learnt nothing useful from the "
                "features."] if old else []
    seed = report.get("config", {}).get("seed")
    lines = ["", f"One run{'' if seed is None else f' (seed {seed})'}: point values without confidence "
             "intervals; `fedmqtt report` over several seeds adds them and paired tests.",
             "", f"Baselines, fitted on {section['fitted_on']} and scored on every site's test split: a model "
             "no better than the constant for a metric has learnt nothing that metric can see; the pooled "
             "reference is what a central analyst would get from the same rows; the site alone predicts each "
             "site's own training constant."]
    if note := section.get("ranking_note"):
        lines += ["", f"{note[0].upper()}{note[1:]}."]
    reference = section.get("pooled_reference") or {}
    if reference and not reference.get("fitted"):
        lines += ["", f"No pooled reference model: {reference['why']}."]
    return lines + [line for w in baseline_warnings(report) for line in ("", f"**Warning:** {w}.")]


def _privacy_lines(report: dict[str, Any]) -> list[str]:
    """Differential privacy: participant-level epsilon per round and final (DP-FedAvg), and each site's
    record-level epsilon (DP-SGD), both at their delta; nothing when the run had neither."""
    privacy = report.get("privacy") or {}
    participant = privacy.get("participant_level") or {}
    record = privacy.get("record_level") or {}
    if not participant and not record:
        return []
    md = ["", "## Differential privacy (docs/privacy.md)"]
    if final := participant.get("final"):
        md += ["", f"Participant-level DP (each hospital's whole data, in every released model): epsilon "
               f"{final['epsilon']:.3g} at delta {final['delta']:g} after {final['rounds']} charged rounds "
               f"({final['accountant']} accountant).", "",
               "| round | epsilon | delta | accountant | rounds charged |", "|---|---|---|---|---|"]
        md += [f"| {p['round']} | {p['epsilon']:.3g} | {p['delta']:g} | {p['accountant']} | {p['rounds']} |"
               for p in participant.get("per_round", [])]
    if record and len(record) <= MAX_SITE_ROWS:
        md += ["", "Record-level DP (each patient's record, as each site's accountant counts it over all its rounds "
               "and runs):", "", "| site | epsilon | delta | accountant | DP-SGD steps |", "|---|---|---|---|---|"]
        md += [f"| {site} | {p['epsilon']:.3g} | {p['delta']:g} | {p['accountant']} | {p['steps']} |"
               for site, p in sorted(record.items())]
    elif record:
        worst = max(p["epsilon"] for p in record.values())
        md += ["", f"Record-level DP: {len(record)} sites, largest epsilon {worst:.3g} (report.json has every site)."]
    return md


def _init_model_notes(init: dict[str, Any] | None) -> list[str]:
    """Round 1 started from a pretrained file: which tensors it set and which kept the seeded initialisation."""
    if not init:
        return []
    lines = ["", "## Starting model", "", f"Round 1 started from `{init['path']}` (sha256 {init['sha256'][:16]}..., "
             f"tensors = \"{init['tensors']}\"): {len(init['loaded'])} tensor(s) loaded, {len(init['kept'])} kept "
             "from the model's seeded initialisation.", ""]
    if init["kept"]:
        lines.append("Kept: " + ", ".join(f"`{name}`" for name in init["kept"]) + ".")
    if init.get("ignored"):
        lines.append("Ignored in the file: " + "; ".join(f"`{name}` ({why})" for name, why in init["ignored"].items())
                     + ".")
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """report.md: final test metrics (a summary when there are more than MAX_SITE_ROWS sites; the full
    table is per_site.csv, `per_site_csv`), the baselines and their warnings when the report has them, mean
    validation metrics per round and the cost of local training. Only the task's metrics are shown."""
    metrics = report_metrics(report)
    md = [f"# fedmqtt run `{report['run_id']}` ({report['algorithm']})", "", "## Final model, test split", ""]
    n_sites = len(report["final"]["per_site"])
    if n_sites > MAX_SITE_ROWS:
        md += [f"{n_sites} sites: summary over sites below; every site's metrics are in `per_site.csv`.", ""]
        md += _md_table(summary_table(report, metrics))
    else:
        md += _md_table(final_table(report, metrics))
    md += _baseline_notes(report)
    md += _init_model_notes(report.get("init_model"))
    md += ["", "## Mean validation metrics per round (model received at the start of the round)", "",
           "| round | sites | " + " | ".join(f"val {m}" for m in metrics) + " | train loss |",
           "|---|---|" + "---|" * len(metrics) + "---|"]
    for r in report["rounds"]:
        md.append(f"| {r['round']} | {len(r['sites'])} | "
                  + " | ".join(_fmt(r["mean"].get(m)) for m in metrics) + f" | {_fmt(r['train_loss'])} |")
    totals = report.get("usage", {}).get("per_site_total", {})
    if totals and len(totals) <= MAX_SITE_ROWS:
        md += ["", "## Cost of local training (all rounds)", "", "| site | rounds | wall s | CPU s | GPU energy J |",
               "|---|---|---|---|---|"]
        md += [f"| {site} | {u['rounds']} | {_fmt(u['wall_s'])} | {_fmt(u['cpu_s'])} | "
               f"{_fmt(u['energy_j'])} |" for site, u in sorted(totals.items())]
    elif totals:
        wall = [u["wall_s"] for u in totals.values() if u["wall_s"] is not None]
        md += ["", f"Cost of local training: {len(totals)} sites, wall time per site mean "
               f"{_fmt(sum(wall) / len(wall) if wall else None)} s, max {_fmt(max(wall) if wall else None)} s "
               "(report.json has every site)."]
    secure = report.get("secure_aggregation") or {}
    if secure.get("enabled"):
        md += ["", "## Secure aggregation", "", "The PS saw only the sum of the updates (SecAgg+).", "",
               "| round | in the sum | dropped | recovered | tries | clipped |", "|---|---|---|---|---|---|"]
        md += [f"| {r['round']} | {r['included']} | {r['dropped']} | {r['recovered']} | {r['tries']} | "
               f"{r.get('clipped', 0)} |" for r in secure.get("per_round", [])]
        if any(r.get("clipped") for r in secure.get("per_round", [])):
            md += ["", "Clipped: sites whose weighted update had coordinates outside the ring's range; those rounds' "
                       "sums are off by more than the encoding's bound (report.json names the sites and counts)."]
    md += _privacy_lines(report)
    t, traffic = report["timings"], report.get("traffic") or {}
    sent = (f"; bytes sent {traffic.get('bytes_sent')}, received {traffic.get('bytes_received')}"
            if traffic else "; no network traffic (pooled in one process)")
    md += ["", f"Wall time {t.get('total_s', 0):.1f} s{sent}.", ""]
    return "\n".join(md)
