"""A pre-imported parent that forks the `fedmqtt` processes of the end-to-end tests (`harness.cli`).

On two cores most of an end-to-end test's CPU went to each process importing the same modules again (torch
and the package: about 1.5 CPU s per site, 0.5 per PS or broker command, several times per test). This process
imports them once; each role is then a fork of it that runs the real entry point (`python -m fedmqtt ARGS`:
fedmqtt/__main__.py with its argv), in its own working folder, environment and log, with default signal
handlers: a real process that shares the imported pages, as a pre-fork server's workers do. The start-up path
itself (a fresh interpreter, `fedmqtt` from an installed wheel) keeps its own tests, which start processes
the usual way (test_wheel.py, test_cli_federation.py's kill-and-resume runs).

Usage: `python zygote.py SOCKET MODULE...`. It prints "ready" once the modules are imported and the socket
listens, and exits when its standard input closes (the test process that started it is gone).

Each request is one JSON line on a new connection: {"args", "cwd", "env", "log"}. An intermediate process forks
the role and answers "pid N", then "rc N" when the role exits (os.waitstatus_to_exitcode): the test signals
the role by pid and learns its exit code through the connection, as it would from its own child.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
from pathlib import Path
from typing import Any

ENTRY = "fedmqtt"
# What a fresh interpreter makes of SIGINT: KeyboardInterrupt, or ignored when it was ignored on entry (a
# background job of a non-interactive shell); this process was started the same way as a fresh one would be.
FRESH_SIGINT = signal.getsignal(signal.SIGINT)


class _Become(Exception):  # noqa: N818 - not an error: unwinds a forked child to the top level
    """Raised in a forked child, caught in main(): the child leaves the server loop and runs the request."""

    def __init__(self, request: dict[str, Any]) -> None:
        super().__init__()
        self.request = request


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("request cut short")
        data += chunk
    return data


def _serve(server: socket.socket) -> None:
    while True:
        ready, _, _ = select.select([server, sys.stdin], [], [], 1.0)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:  # intermediates whose role has exited
                pass
        if sys.stdin in ready and not sys.stdin.buffer.read1(1):
            return
        if server not in ready:
            continue
        conn, _ = server.accept()
        with conn:
            request = json.loads(_read_line(conn))
            if os.fork() == 0:  # the intermediate: forks the role, reports its pid and exit code
                server.close()
                role = os.fork()
                if role == 0:
                    conn.close()
                    raise _Become(request)
                try:
                    conn.sendall(f"pid {role}\n".encode())
                    _, status = os.waitpid(role, 0)
                    conn.sendall(f"rc {os.waitstatus_to_exitcode(status)}\n".encode())
                finally:
                    os._exit(0)


def _become(request: dict[str, Any]) -> None:
    """Turn this forked child into `python -m fedmqtt ARGS` with the request's folder, environment and log."""
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGINT, FRESH_SIGINT)  # as a fresh interpreter started here would have them
    for signum in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    main_file = importlib.import_module(ENTRY).__file__
    assert main_file is not None
    sys.argv = [str(Path(main_file).with_name("__main__.py")), *request["args"]]
    runpy.run_module(ENTRY, run_name="__main__", alter_sys=True)


def main() -> None:
    sys.path[0] = os.getcwd()  # as `python -m fedmqtt` run here would have it, not this script's folder
    path, modules = sys.argv[1], sys.argv[2:]
    for name in modules:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # what the imports made stays out of the children's collections: their pages stay shared
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    try:
        _serve(server)
    except _Become as become:
        _become(become.request)
        return
    server.close()


if __name__ == "__main__":
    main()
