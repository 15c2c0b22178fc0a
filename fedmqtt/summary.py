"""One-line human summaries of decoded messages (sizes and hashes, never tensor values)."""

from __future__ import annotations

from schemas import messages as m
from schemas.chunks import Chunk, ChunkManifest
from schemas.signed import KeyList


def _metrics(values: dict) -> str:
    shown = [f"{k}={'n/a' if v is None else f'{v:.3f}'}" for k, v in sorted(values.items())
             if k in ("auroc", "accuracy", "loss")]
    return " ".join(shown) or "-"


def _tensors(blobs: tuple) -> str:
    return f"{len(blobs)} tensors, {sum(b.nbytes for b in blobs):,} B"


def summarize(msg: object) -> str:
    if isinstance(msg, m.GlobalModel):
        return f"model {msg.model.name} hash {msg.model_hash[:12]}: {_tensors(msg.tensors)}"
    if isinstance(msg, m.TrainTask):
        s = msg.settings
        return (f"train task for {msg.site_id}: model {msg.model_hash[:12]}, {s.algorithm} {s.optimizer} "
                f"lr={s.lr} epochs={s.epochs} batch={s.batch_size}")
    if isinstance(msg, m.EvalTask):
        return f"eval task for {msg.site_id}: model {msg.model_hash[:12]} on {','.join(msg.splits)} ({msg.tag})"
    if isinstance(msg, m.ClientUpdate):
        loss = "n/a" if msg.train_loss is None else f"{msg.train_loss:.4f}"
        cost = ""
        if msg.usage is not None and msg.usage.energy_j is not None:
            cost = f", {msg.usage.energy_j:.0f} J on {msg.usage.device}"
        return (f"update: {_tensors(msg.tensors)}, n={msg.n_samples}, steps={msg.local_steps}, loss={loss}, "
                f"val {_metrics(msg.val_metrics)}, {msg.compute_seconds:.2f} s{cost}")
    if isinstance(msg, m.EvalReport):
        return " | ".join(f"{split} {_metrics(v)}" for split, v in msg.metrics.items()) + f" ({msg.tag})"
    if isinstance(msg, m.SiteStatus):
        return f"site {msg.state} on {msg.device}: {msg.n_train}/{msg.n_val}/{msg.n_test} rows {msg.detail}".rstrip()
    if isinstance(msg, m.DaemonStatus):
        waiting = f", waiting for {','.join(msg.waiting_for)}" if msg.waiting_for else ""
        turns = f", upload turns {','.join(msg.upload_turns)}" if msg.upload_turns else ""
        return f"PS {msg.state} round {msg.round}/{msg.rounds_total} {msg.algorithm}{waiting}{turns}: {msg.detail}"
    if isinstance(msg, m.RoundMetrics):
        return f"{msg.phase} metrics: mean {_metrics(msg.mean)} over {','.join(msg.sites)}"
    if isinstance(msg, ChunkManifest):
        return (f"{msg.inner_kind} of {msg.total_bytes:,} B in {msg.count} chunks "
                f"(transfer {msg.transfer_id[:12]}, root {msg.root_sha256[:12]})")
    if isinstance(msg, KeyList):
        return f"key list version {msg.version}: {', '.join(sorted(msg.keys))}"
    if isinstance(msg, Chunk):
        return f"chunk {msg.index} of transfer {msg.transfer_id[:12]}: {len(msg.data):,} B"
    return type(msg).__name__
