"""fedmqtt.startup.imports_without_gc: the collector off inside, on again after the last open section (nested, or
from several threads), and left alone when someone else had turned it off (issue 30, goal 3)."""

from __future__ import annotations

import gc
import threading

from fedmqtt.startup import imports_without_gc


def test_the_collector_is_off_inside_and_on_after_nested_sections() -> None:
    assert gc.isenabled()
    with imports_without_gc():
        assert not gc.isenabled()
        with imports_without_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer section is still open
    assert gc.isenabled()


def test_a_section_on_another_thread_keeps_the_collector_off_until_both_end() -> None:
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with imports_without_gc():
            inside.set()
            leave.wait(10)

    worker = threading.Thread(target=other)
    with imports_without_gc():
        worker.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the worker's section is still open
    leave.set()
    worker.join(10)
    assert gc.isenabled()


def test_a_collector_turned_off_by_someone_else_stays_off() -> None:
    gc.disable()
    try:
        with imports_without_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_collector_is_on_again_when_an_import_fails() -> None:
    try:
        with imports_without_gc():
            raise ImportError("no such module")
    except ImportError:
        pass
    assert gc.isenabled()
