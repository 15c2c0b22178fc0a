"""What a site keeps between rounds (local layers, SCAFFOLD c_i, FedDyn s_i), with the commit rule.

docs/algorithms.md 0.6: state changed in round t is written as *pending for round t* before the update
is published; the next downlink's `accepted_round` (the round of our last update the PS aggregated)
says whether it did:
if yes the pending state becomes committed, if no it is discarded. So a site whose update was
lost never drifts away from the server's view of it (SCAFFOLD's c = sum pi_i c_i, FedDyn's S_bar).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import msgpack
import numpy as np

from fedmqtt.atomic import SPARE_FROM, make_spare, private_dir, replace_atomic, write_atomic
from schemas.tensors import TensorBlob, arrays_to_blobs

log = logging.getLogger(__name__)
Groups = dict[str, dict[str, np.ndarray]]


class LocalState:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        private_dir(self.folder)
        self._committed = self.folder / "committed.msgpack"
        self._pending = self.folder / "pending.msgpack"

    def committed(self) -> Groups:
        return self._read(self._committed)[1]

    def stage(self, round_no: int, groups: Groups) -> None:
        """Write the state produced by round `round_no` as pending (durable before the uplink leaves).

        A site that keeps no state at all (FedAvg and every rule without local layers or variates) writes
        nothing: committing an empty pending file would change nothing, and its two fsyncs cost every round."""
        committed = self.committed()
        merged = {**committed, **groups}  # groups not touched this round stay as committed
        if not any(merged.values()):
            return
        self._write(self._pending, round_no, merged)

    def resolve(self, accepted_round: int | None, round_no: int) -> None:
        """Apply the PS's verdict, given with a task of round `round_no`, on our pending update."""
        if not self._pending.exists():
            return
        pending_round, _ = self._read(self._pending)
        if pending_round >= round_no:
            return  # pending belongs to this very round (a re-sent task): keep it
        if accepted_round is not None and accepted_round >= pending_round:
            os.replace(self._pending, self._committed)
        else:
            log.warning("the PS did not aggregate our round %d update: discarding its local state", pending_round)
            self._pending.unlink()

    @staticmethod
    def _read(path: Path) -> tuple[int, Groups]:
        if not path.exists():
            return 0, {}
        raw = msgpack.unpackb(path.read_bytes(), raw=False)
        groups = {g: {b["name"]: TensorBlob.model_validate(b).to_numpy().copy() for b in blobs}
                  for g, blobs in raw["groups"].items()}
        return int(raw["round"]), groups

    @staticmethod
    def _write(path: Path, round_no: int, groups: Groups) -> None:
        data = {"round": round_no,
                "groups": {g: [b.model_dump() for b in arrays_to_blobs(w)] for g, w in groups.items()}}
        write_atomic(path, msgpack.packb(data, use_bin_type=True))


class BestSlot:
    """Hwang et al.'s best-round protocol on the site (docs/algorithms.md 17.1): keep the composed model last
    evaluated; when a downlink names that round as the best so far, copy it into the "best" slot.
    Both live on disk, so a restarted agent still has them."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        private_dir(self.folder)

    def remember(self, round_no: int, weights: dict[str, np.ndarray]) -> None:
        """Keep the model evaluated in round `round_no`: atomic (a crash leaves the old file or the new one,
        never half), but not forced to disk. The slot is no part of the commit rule (docs/algorithms.md 0.6):
        a process that dies keeps it (the page cache outlives it), and a machine that loses power keeps an
        older evaluated model or an unreadable one, which is then not promoted (`_round_of`); the report names
        the round its best model is from. An fsync of a model-sized file every round made the site wait about
        10 ms at 16 MB.

        The file is written over a spare one (the previous evaluated model, or the best one `promote` replaced),
        so the pages of a model-sized file are reused each round rather than freed and allocated again (about
        3 ms at 16 MB); a spare that still has another name (a crash inside `promote`) is never written over."""
        evaluated, spare = self.folder / "evaluated.safetensors", self.folder / "spare.safetensors"
        if evaluated.exists() and not spare.exists():
            # An earlier round's evaluated model: `promote` has judged it already (every task names the best round
            # after the round evaluated last has closed), so it is no longer needed; it becomes the spare.
            os.replace(evaluated, spare)
        fresh = not spare.exists()  # nothing to write over: this model's file is new
        written = _save(evaluated, round_no, weights, durable=False, recycle=spare)
        spare.unlink(missing_ok=True)  # not taken (a dtype save_file writes, a second name): no third model on disk
        if fresh and written and evaluated.stat().st_size >= SPARE_FROM:
            # The next round would need a new file too (its promotion moves this one to the best slot, which
            # has no older best to give up): make it now, once per process, not in that round (`make_spare`).
            # Two model files, as the slot holds from its second round on (evaluated and best).
            make_spare(spare, evaluated.stat().st_size)

    def promote(self, best_round: int | None) -> None:
        evaluated = self.folder / "evaluated.safetensors"
        if best_round is None or not evaluated.exists():
            return
        if _round_of(evaluated) == best_round:
            best, spare = self.folder / "best.safetensors", self.folder / "spare.safetensors"
            if best.exists() and not spare.exists():
                try:
                    os.link(best, spare)  # the replaced best's pages live on as the next evaluated model's
                except OSError:
                    pass  # a file system without hard links: nothing reused
            os.replace(evaluated, best)

    def slot(self) -> tuple[int | None, dict[str, np.ndarray] | None]:
        """(round, weights) of the best slot; (None, None) when empty or unreadable (a machine that lost power
        after a promotion: the slot is not fsynced, see `remember`)."""
        path = self.folder / "best.safetensors"
        if not path.exists():
            return None, None
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        try:
            return _round_of(path), load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            log.warning("the best model in %s cannot be read (%s): no best model to evaluate", path, exc)
            return None, None


def _save(path: Path, round_no: int, weights: dict[str, np.ndarray], *, durable: bool,
          recycle: Path | None = None) -> bool:
    """The safetensors file of `weights` with the round in its metadata, written from the arrays' own memory
    (`save` would build the file in memory twice over: a 512 MB model cost a site 1.5 GB more at its peak).
    Over `recycle` (see `write_atomic`) when every dtype is one `safetensors_pieces` writes; else by safetensors'
    own save_file. True if written from the pieces (a file later rounds can write over), False by save_file."""
    arrays = {k: np.require(v, requirements="C") for k, v in weights.items()}
    metadata = {"round": str(round_no)}
    pieces = safetensors_pieces(arrays, metadata)
    if pieces is not None:
        write_atomic(path, pieces, durable=durable, recycle=recycle)
        return True
    from safetensors.numpy import save_file

    replace_atomic(path, lambda tmp: save_file(arrays, str(tmp), metadata=metadata), durable=durable)
    return False


# numpy's little-endian dtypes -> safetensors' names, in the order its writer lays tensors out (its dtype order,
# descending; then by name)
_SAFETENSORS_DTYPES = {"<i8": "I64", "<f8": "F64", "<f4": "F32", "<i4": "I32", "<f2": "F16", "<i2": "I16",
                       "|i1": "I8", "|u1": "U8", "|b1": "BOOL"}
_SAFETENSORS_RANK = {name: rank for rank, name in enumerate(_SAFETENSORS_DTYPES.values())}


def safetensors_pieces(arrays: dict[str, np.ndarray], metadata: dict[str, str]
                       ) -> list[bytes | memoryview] | None:
    """The bytes safetensors' save_file writes for these C-contiguous `arrays`, as pieces: the header, then each
    array's own memory (no copy). None for a dtype outside the table (save_file then writes it)."""
    names = {}
    for name, array in arrays.items():
        st = _SAFETENSORS_DTYPES.get(array.dtype.str)
        if st is None or not array.flags.c_contiguous:
            return None
        names[name] = st
    order = sorted(arrays, key=lambda n: (_SAFETENSORS_RANK[names[n]], n))
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        array = arrays[name]
        header[name] = {"dtype": names[name], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return [len(text).to_bytes(8, "little") + text,
            *(arrays[name].reshape(-1).data.cast("B") for name in order if arrays[name].nbytes)]


def _round_of(path: Path) -> int:
    """The round a slot file was written for; -1 if it cannot be read (then it is never promoted)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as fh:
            return int((fh.metadata() or {}).get("round", -1))
    except (SafetensorError, OSError, ValueError) as exc:
        log.warning("%s cannot be read (%s): not used as the best model", path, exc)
        return -1
