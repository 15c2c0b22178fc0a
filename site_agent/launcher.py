"""Several site agents on one host from one interpreter: `fedmqtt site start --config A --config B ...`.

For a researcher's local federation, a benchmark or a test run on one machine (a hospital runs one site): N
`site start` processes pay N interpreter starts, about 1.4 CPU s of imports each (torch most of it), which on a
small machine is most of what a short deployed run costs beyond the in-process one (issue 30). Here the parent
imports once (the agent's modules and torch), then forks one child per site before any thread of its own
exists. Each child is a whole site process from there on: its own config, data, state folder, MQTT connection
and torch threads, the same agent as `site start --config A`; its log lines carry its site id.

The parent only supervises: it relays SIGTERM and SIGINT to the children (each stops as `site start` does,
saying "offline"), reports each child's end with its cause (exit code or signal), and exits with the first
failure's code (0 when all ended well). A child that fails does not stop the others: they are separate sites.
A child whose parent is gone (killed with SIGKILL) is sent SIGTERM by the kernel (Linux), and stops.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from fedmqtt.errors import ConfigError, FedMqttError
from site_agent.config import SiteConfig, load_site_config

log = logging.getLogger("fedmqtt.sites")

PR_SET_PDEATHSIG = 1  # linux/prctl.h
RELAYED = {signal.SIGTERM, signal.SIGINT}


def run_sites(config_paths: Sequence[Path], *, exit_when_done: bool, verbose: bool) -> int:
    """Start one forked site process per config and wait for all of them; the exit code to leave with."""
    from fedmqtt.logs import setup_logging

    if not hasattr(os, "fork"):
        raise ConfigError("several --config need os.fork (Linux, macOS); start one `fedmqtt site start` per site")
    configs = [load_site_config(p) for p in config_paths]  # every config is checked before anything starts
    for key, what in ((lambda c: c.site_id, "site id"), (lambda c: c.state_dir.resolve(), "state_dir")):
        seen = [key(c) for c in configs]
        twice = sorted({str(v) for v in seen if seen.count(v) > 1})
        if twice:
            raise ConfigError(f"each --config needs its own {what}; given twice: {', '.join(twice)}")
    setup_logging(verbose, tag="sites")
    import site_agent.trainer  # noqa: F401 - torch, once for every child (the agent imports it on a thread)
    from fedmqtt.startup import keep_what_is_loaded

    if threading.active_count() != 1:  # forking with threads would copy their locks, held or not, into the children
        raise RuntimeError(f"{threading.active_count()} threads before forking the sites; expected only this one")
    keep_what_is_loaded()  # the children's collections never touch the shared pages of what was imported
    supervisor = _Supervisor()
    for config in configs:
        if supervisor.stopping:  # asked to stop while starting: start no more
            break
        sys.stdout.flush()
        sys.stderr.flush()
        # Blocked across the fork: a child must never run the parent's relay (it would signal its siblings), and
        # a signal that comes meanwhile reaches the parent's relay once the new child is on its list.
        signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)
        pid = os.fork()
        if pid == 0:
            os._exit(_child(config, exit_when_done=exit_when_done, verbose=verbose))
        supervisor.children[pid] = config.site_id
        signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
        log.info("site %s started as process %d", config.site_id, pid)
    return supervisor.wait()


def _child(config: SiteConfig, *, exit_when_done: bool, verbose: bool) -> int:
    """A forked site: the same run as `fedmqtt site start --config`, its exit code returned (never raises)."""
    from fedmqtt.logs import setup_logging
    from site_agent.agent import SiteAgent

    code = 0
    try:
        for signum in RELAYED:  # as a fresh process has them; the agent installs its own in run()
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
        _stop_with_parent()
        setup_logging(verbose, tag=config.site_id)
        SiteAgent(config).run(exit_when_done=exit_when_done)
    except FedMqttError as exc:
        log.error("site %s: %s", config.site_id, exc)
        code = 2
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - a child never unwinds into the parent's loop: logged, exit code 1
        log.exception("site %s failed", config.site_id)
        code = 1
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def _stop_with_parent() -> None:
    """SIGTERM to this child when the parent dies (Linux's PR_SET_PDEATHSIG); elsewhere nothing."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the call: no signal would come
        os.kill(os.getpid(), signal.SIGTERM)


class _Supervisor:
    """The parent's side: relays SIGTERM and SIGINT to every child still running, waits for them all."""

    def __init__(self) -> None:
        self.children: dict[int, str] = {}
        self.stopping = False
        for signum in RELAYED:
            signal.signal(signum, self._relay)

    def _relay(self, signum: int, frame: object) -> None:
        self.stopping = True
        for pid in list(self.children):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def wait(self) -> int:
        """Wait for every child; log each end with its cause; the first failure's exit code, else 0."""
        first_failure = 0
        while self.children:
            pid, status = os.waitpid(-1, 0)  # retried by Python after a relayed signal's handler has run
            site = self.children.pop(pid, None)
            if site is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            # Stopped by a relayed signal before its agent had its own handlers (SIGINT: KeyboardInterrupt, 130)
            relayed = self.stopping and (-code in RELAYED or code == 128 + signal.SIGINT)
            if code == 0 or relayed:
                log.info("site %s (process %d) %s", site, pid, "stopped" if relayed else "exited")
                continue
            cause = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            log.error("site %s (process %d) %s; %d other site(s) still running", site, pid, cause,
                      len(self.children))
            first_failure = first_failure or (128 - code if code < 0 else code)
        return first_failure


__all__ = ["run_sites"]
