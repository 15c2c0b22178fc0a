"""The site's best-round slot on disk (site_agent/local_state.py): the evaluated model is written as safetensors'
own bytes from the arrays' memory, over a spare file whose pages are reused, and a promotion or a crash inside
one never lets that reuse touch the best model."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from site_agent.local_state import BestSlot, safetensors_pieces

DTYPES = ["<f4", "<f8", "<f2", "<i8", "<i4", "<i2", "|i1", "|u1", "|b1"]
ARRAYS = st.dictionaries(
    st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF), min_size=1, max_size=12),
    st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 4), max_size=3), st.integers(0, 2**32 - 1)),
    max_size=6)


def _arrays(spec: dict) -> dict[str, np.ndarray]:
    out = {}
    for name, (dtype, shape, seed) in spec.items():
        raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize,
                                                   dtype=np.uint8)
        values = raw.view(dtype).reshape(shape)
        if dtype == "|b1":
            values = raw.astype(bool).reshape(shape)
        out[name] = np.asarray(np.nan_to_num(values) if values.dtype.kind == "f" else values)
    return out


@settings(max_examples=150, deadline=None)
@given(ARRAYS, st.integers(0, 10**7))
def test_the_pieces_are_the_bytes_save_file_writes(tmp_path_factory, spec: dict, round_no: int) -> None:
    # Prepare
    arrays = _arrays(spec)
    folder = tmp_path_factory.mktemp("st")
    save_file(arrays, str(folder / "theirs"), metadata={"round": str(round_no)})
    # Execute
    pieces = safetensors_pieces(arrays, {"round": str(round_no)})
    # Assert: byte for byte, and safetensors reads back the same arrays
    assert pieces is not None
    ours = b"".join(bytes(p) for p in pieces)
    assert ours == (folder / "theirs").read_bytes()
    (folder / "ours").write_bytes(ours)
    back = load_file(str(folder / "ours"))
    assert back.keys() == arrays.keys() and all(np.array_equal(back[k], arrays[k]) for k in arrays)


def test_a_dtype_outside_the_table_is_left_to_save_file(tmp_path: Path) -> None:
    # Prepare: big-endian floats (never from the wire, but a caller could pass them)
    weights = {"w": np.arange(5, dtype=">f4")}
    slot = BestSlot(tmp_path / "best")
    # Execute
    assert safetensors_pieces(weights, {}) is None
    slot.remember(1, weights)
    slot.promote(1)
    slot.remember(2, weights)
    slot.promote(2)  # the replaced best becomes a spare, which save_file cannot write over
    slot.remember(3, weights)
    # Assert: read back as written; no spare model file left beside the slot's two
    round_no, back = slot.slot()
    assert round_no == 2 and back is not None and np.array_equal(back["w"], weights["w"])
    assert sorted(p.name for p in (tmp_path / "best").iterdir()) == ["best.safetensors", "evaluated.safetensors"]


def _model(round_no: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(round_no)
    return {"fc.weight": rng.normal(size=(300, 200)).astype(np.float32), "fc.bias": np.full(200, round_no, "<f4"),
            "steps": np.array([round_no], np.int64)}


def _same(a: dict[str, np.ndarray] | None, b: dict[str, np.ndarray]) -> bool:
    return a is not None and a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in b)


def test_rounds_promoted_or_not_keep_the_right_models_and_reuse_one_file(tmp_path: Path) -> None:
    # Prepare: best rounds as the PS would name them (round 3 stays best through round 5)
    slot = BestSlot(tmp_path / "best")
    best_named = {1: None, 2: 1, 3: 2, 4: 3, 5: 3, 6: 3, 7: 6}
    inodes = set()
    for round_no, best_round in best_named.items():
        # Execute: what a train task does
        slot.promote(best_round)
        slot.remember(round_no, _model(round_no))
        inodes.add((tmp_path / "best" / "evaluated.safetensors").stat().st_ino)
        # Assert: the best slot holds the named round's model; the evaluated one this round's
        got_round, got = slot.slot()
        if best_round is None:
            assert got_round is None
        else:
            assert got_round == best_round and _same(got, _model(best_round))
        assert _same(load_file(str(tmp_path / "best" / "evaluated.safetensors")), _model(round_no))
    # From round 3 on every evaluated model went into a file that existed already: at most three inodes in all
    assert len(inodes) <= 3
    assert {p.name for p in (tmp_path / "best").iterdir()} <= {"evaluated.safetensors", "best.safetensors",
                                                                "spare.safetensors"}


def test_a_crash_inside_promote_never_lets_the_next_model_overwrite_the_best(tmp_path: Path) -> None:
    # Prepare: round 2 is best; round 3 evaluated; a crash after promote linked best -> spare, before the rename
    slot = BestSlot(tmp_path / "best")
    slot.remember(2, _model(2))
    slot.promote(2)
    slot.remember(3, _model(3))
    folder = tmp_path / "best"
    (folder / "spare.safetensors").unlink(missing_ok=True)
    os.link(folder / "best.safetensors", folder / "spare.safetensors")
    # Execute: the restarted site's next task does not name round 3; round 4 is evaluated
    restarted = BestSlot(folder)
    restarted.promote(2)
    restarted.remember(4, _model(4))
    # Assert: the best model is still round 2's, bit for bit; the stray second name is gone
    got_round, got = restarted.slot()
    assert got_round == 2 and _same(got, _model(2))
    assert _same(load_file(str(folder / "evaluated.safetensors")), _model(4))
    assert not (folder / "spare.safetensors").exists() and (folder / "best.safetensors").stat().st_nlink == 1


def _big_model(round_no: int) -> dict[str, np.ndarray]:
    """A model over SPARE_FROM bytes: one the slot makes a spare file for."""
    rng = np.random.default_rng(round_no)
    return {"fc.weight": rng.normal(size=(600, 500)).astype(np.float32), "fc.bias": np.full(500, round_no, "<f4")}


def test_a_model_sized_slot_creates_its_files_in_the_first_round_only(tmp_path: Path) -> None:
    # Prepare: round 1 best after round 1, then round 2 best, then round 2 stays best (as the PS would name them)
    folder = tmp_path / "best"
    slot = BestSlot(folder)
    best_named = {1: None, 2: 1, 3: 2, 4: 2, 5: 4, 6: 4}
    inodes_after_round_1: set[int] = set()
    for round_no, best_round in best_named.items():
        # Execute: what a train task does
        slot.promote(best_round)
        slot.remember(round_no, _big_model(round_no))
        # Assert: the right models; never more than three model files; after round 1, never a new inode
        got_round, got = slot.slot()
        assert got_round == best_round and (best_round is None or _same(got, _big_model(best_round)))
        assert _same(load_file(str(folder / "evaluated.safetensors")), _big_model(round_no))
        inodes = {p.stat().st_ino for p in folder.iterdir()}
        assert len(inodes) <= 3
        if round_no == 1:
            assert sorted(p.name for p in folder.iterdir()) == ["evaluated.safetensors", "spare.safetensors"]
            inodes_after_round_1 = inodes
        else:
            assert inodes <= inodes_after_round_1  # the evaluated and the best model live in round 1's two files
