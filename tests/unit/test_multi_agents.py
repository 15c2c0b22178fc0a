"""The scheduler that polls several site agents in one thread (site_agent.multi, used by the benchmarks).

The agents here are stand-ins that record what they are asked to do: the scheduling order is what is
under test, not MQTT (the benchmarks run the real agents against a real broker).
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from site_agent.multi import MESSAGES_PER_PASS, serve


class RecordingAgent:
    def __init__(self, name: str, log: list[tuple[str, str]], *, tasks: int = 0) -> None:
        self.name, self.log, self.tasks = name, log, tasks
        self.inbox: deque[str] = deque()
        self.after_work: list[str] = []  # messages that arrive once this agent has worked (e.g. an upload turn)
        self.channel = SimpleNamespace(stats=SimpleNamespace(received=0))

    def receive(self, timeout_s: float) -> None:
        if self.inbox:
            self.channel.stats.received += 1
            self.log.append((self.name, self.inbox.popleft()))

    def work(self) -> bool:
        if not self.tasks:
            return False
        self.tasks -= 1
        self.log.append((self.name, "work"))
        self.inbox.extend(self.after_work)
        self.after_work = []
        return True


def run(agents: list[RecordingAgent], log: list, until_len: int) -> None:
    passes = iter(range(1_000))  # bounded: an idle pass sleeps 10 ms, so a scheduler that stalls fails in ~10 s
    serve(agents, until=lambda: len(log) >= until_len or next(passes) == 999)  # type: ignore[arg-type]


def test_an_upload_turn_is_answered_before_the_next_agents_work() -> None:
    log: list[tuple[str, str]] = []
    a, b, c = (RecordingAgent(n, log, tasks=1) for n in "abc")
    a.after_work = ["turn"]
    run([a, b, c], log, until_len=4)
    assert log == [("a", "work"), ("a", "turn"), ("b", "work"), ("c", "work")]


def test_one_agent_cannot_hold_the_thread_with_a_long_queue() -> None:
    log: list[tuple[str, str]] = []
    a, b = RecordingAgent("a", log), RecordingAgent("b", log)
    a.inbox.extend(f"chunk {i}" for i in range(3 * MESSAGES_PER_PASS))
    b.inbox.append("turn")
    run([a, b], log, until_len=3 * MESSAGES_PER_PASS + 1)
    assert log.index(("b", "turn")) == MESSAGES_PER_PASS
    assert len(log) == 3 * MESSAGES_PER_PASS + 1


def test_work_goes_round_robin() -> None:
    log: list[tuple[str, str]] = []
    agents = [RecordingAgent(n, log, tasks=2) for n in "abc"]
    agents[1].tasks = 1
    run(agents, log, until_len=5)
    assert [name for name, _ in log] == ["a", "b", "c", "a", "c"]
