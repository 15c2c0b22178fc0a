"""UploadTurns: at most `slots` large uploads at once, oldest announcement first, unused turns taken back."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ps_daemon.turns import TURN_MIN_RATE_BYTES_PER_S, UploadTurns

SITES = ("a", "b", "c", "d")


def _update(turns: UploadTurns, now: float, *, wanted=SITES, round_no: int = 1, uploading=()) -> bool:
    return turns.update(now, round_no=round_no, wanted=wanted, uploading=lambda site: site in uploading)


def test_turns_go_to_the_oldest_announcements_and_never_exceed_the_slots() -> None:
    turns = UploadTurns(2, first_grant=100)
    for t, site in enumerate(("c", "a", "d")):
        turns.announce(site, 1, 10, float(t))
    assert _update(turns, 5.0)
    assert turns.view() == {"a": 101, "c": 100}
    assert turns.waiting() == ["d"]
    assert not _update(turns, 6.0)  # nothing changed: ps/status need not be sent again
    turns.forget("c")  # its update arrived
    assert _update(turns, 7.0)
    assert turns.view() == {"a": 101, "d": 102}


def test_large_updates_go_up_one_at_a_time_within_the_byte_budget() -> None:
    # Prepare: two turns, but 100 bytes of updates at the broker at once
    turns = UploadTurns(2, max_bytes=100)
    turns.announce("a", 1, 60, 0.0)
    turns.announce("b", 1, 60, 1.0)
    turns.announce("c", 1, 30, 2.0)

    # Execute / Assert: a alone (a + b would be 120); c waits behind b rather than overtaking it
    _update(turns, 3.0)
    assert turns.view() == {"a": 1} and turns.waiting() == ["b", "c"]
    turns.forget("a")
    _update(turns, 4.0)
    assert turns.view() == {"b": 2, "c": 3}  # 60 + 30 fit


def test_one_turn_is_granted_whatever_the_size_of_the_update() -> None:
    turns = UploadTurns(2, max_bytes=100)
    turns.announce("a", 1, 10**9, 0.0)
    _update(turns, 1.0)
    assert turns.view() == {"a": 1}


def test_a_repeated_announcement_keeps_its_place_and_its_turn() -> None:
    turns = UploadTurns(1)
    turns.announce("a", 1, 10, 0.0)
    turns.announce("b", 1, 10, 1.0)
    _update(turns, 2.0)
    turns.announce("a", 1, 10, 3.0)
    assert not _update(turns, 3.0)
    assert turns.view() == {"a": 1}


def test_what_the_round_no_longer_needs_is_dropped() -> None:
    turns = UploadTurns(4)
    turns.announce("a", 1, 10, 0.0)
    turns.announce("b", 0, 10, 0.0)  # a round that has closed
    turns.announce("c", 1, 10, 0.0)  # not selected, or its update arrived
    _update(turns, 1.0, wanted=("a", "b"))
    assert turns.view() == {"a": 1}
    assert turns.waiting() == []
    _update(turns, 2.0, round_no=2, wanted=("a", "b"))  # round 1 closed without a's update
    assert turns.view() == {}


def test_an_unused_turn_is_taken_back_after_the_grace_and_the_site_waits_behind_the_others() -> None:
    turns = UploadTurns(1, grace_s=10.0)
    turns.announce("a", 1, 10, 0.0)
    turns.announce("b", 1, 10, 1.0)
    _update(turns, 2.0)
    assert turns.view() == {"a": 1}
    assert not _update(turns, 30.0, uploading=("a",))  # its transfer is under way: no grace applies
    assert _update(turns, 31.0)  # not uploading and past the grace
    assert turns.view() == {"b": 2}
    assert turns.waiting() == ["a"]
    turns.forget("b")
    _update(turns, 32.0)
    assert turns.view() == {"a": 3}  # a new grant number: the site answers it


def test_a_new_announcement_for_another_round_ends_the_old_turn() -> None:
    turns = UploadTurns(1)
    turns.announce("a", 1, 10, 0.0)
    _update(turns, 1.0)
    turns.announce("a", 2, 10, 2.0)
    assert turns.view() == {}
    _update(turns, 3.0, round_no=2)
    assert turns.view() == {"a": 2}


def test_a_large_update_gets_time_to_publish_its_chunks_before_its_turn_is_taken_back() -> None:
    turns = UploadTurns(1, grace_s=10.0)
    turns.announce("a", 1, 100 * TURN_MIN_RATE_BYTES_PER_S, 0.0)  # 100 s of chunks at the slowest rate allowed
    turns.announce("b", 1, 10, 0.0)
    _update(turns, 1.0)
    assert not _update(turns, 100.0)
    assert _update(turns, 112.0)
    assert turns.view() == {"b": 2}


def test_topics_watch_names_the_sites_that_upload_now() -> None:
    from fedmqtt.summary import summarize
    from schemas import messages as m

    status = m.DaemonStatus(run_id="r", sender="ps", round=2, state="training", rounds_total=5,
                            waiting_for=("a", "b"), upload_turns={"a": 3})
    assert "waiting for a,b, upload turns a" in summarize(status)
    ready = m.SiteStatus(run_id="r", sender="b", round=2, state="update_ready", update_bytes=5_000_000)
    assert summarize(ready).startswith("site update_ready")


SITE = st.sampled_from(SITES)
ACTION = st.one_of(
    st.tuples(st.just("announce"), SITE, st.integers(1, 2), st.integers(0, 10**9)),
    st.tuples(st.just("forget"), SITE),
    st.tuples(st.just("update"), st.integers(1, 2), st.frozensets(SITE, min_size=2), st.frozensets(SITE)),
)


@settings(max_examples=300, deadline=None)
@given(slots=st.integers(1, 3), max_bytes=st.none() | st.integers(1, 2 * 10**9),
       actions=st.lists(st.tuples(ACTION, st.floats(0, 100)), max_size=40))
def test_turns_never_exceed_the_slots_and_each_grant_is_new(slots: int, max_bytes: int | None, actions: list) -> None:
    """Whatever sites announce, forget and the round asks for: at most `slots` turns, more than one only within
    `max_bytes`, only to sites the open round still wants with an announcement of that round, and a grant number
    never given before."""
    turns = UploadTurns(slots, grace_s=5.0, max_bytes=max_bytes)
    now, given_out = 0.0, set()
    for action, dt in actions:
        now += dt
        if action[0] == "announce":
            turns.announce(action[1], action[2], action[3], now)
        elif action[0] == "forget":
            turns.forget(action[1])
        else:
            _, round_no, wanted, uploading = action
            before = turns.view()
            _update(turns, now, wanted=wanted, round_no=round_no, uploading=uploading)
            view = turns.view()
            assert len(view) <= slots
            assert all(site in wanted and turns.ready[site].round == round_no for site in view)
            fresh = [g for site, g in view.items() if before.get(site) != g]
            assert len(set(fresh)) == len(fresh) and not set(fresh) & given_out
            given_out |= set(fresh)
            held = sum(turns.ready[site].nbytes for site in view)
            if max_bytes is not None and len(view) > 1:
                assert held <= max_bytes
            waiting = turns.waiting()
            if len(view) < slots and waiting:  # a free turn is left only to keep within the bytes
                assert view and max_bytes is not None and held + turns.ready[waiting[0]].nbytes > max_bytes


def test_upload_turns_may_change_across_a_resume_but_the_rounds_may_not() -> None:
    from ps_daemon.config import DaemonConfig

    def config_hash(**extra: object) -> str:
        raw = {"run_id": "r", "sites": ["a", "b"], "model": {"name": "mlp", "args": {}}, "credentials": "c.toml"}
        return DaemonConfig.model_validate({**raw, **extra}).config_hash()

    assert config_hash(upload_turns=1) == config_hash(upload_turns=4) == config_hash()
    assert config_hash(rounds=3) != config_hash(rounds=4)
