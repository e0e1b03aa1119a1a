"""A child role dies with the process that started it: it asks the kernel for SIGKILL when its parent
dies (PR_SET_PDEATHSIG), and a watcher thread backs that up. The launcher names itself on the command line
(`--watch-parent PID`): a parent that died while the child was still importing (seconds, with torch) has
already handed it to init, so the child cannot learn who its parent was from getppid(), and would live on
(a serve SIGKILLed right after start left its scheduler and executor running, in CI)."""
from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """The kernel SIGKILLs this process when its parent dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: --watch-parent still covers it


def watch_parent(parent_pid: int = 0) -> None:
    """In a child role: exit when the process that started us (parent_pid; 0: whoever is our parent now) is
    gone, backing up PR_SET_PDEATHSIG, and leave Ctrl-C to the parent, which owns shutdown."""
    import threading
    import time

    parent_pid = parent_pid or os.getppid()
    die_with_parent()
    if os.getppid() != parent_pid:  # it died before the kernel was asked to tell us
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=watch, daemon=True, name="watch-parent").start()


def add_watch_parent_flag(parser, hidden: bool = False) -> None:
    """`--watch-parent [PID]`: exit when PID (the launcher gives its own; alone: the parent at start) is gone."""
    import argparse

    parser.add_argument("--watch-parent", nargs="?", type=int, const=0, default=None, metavar="PID",
                        help=argparse.SUPPRESS if hidden else "exit when this process (default: the parent at "
                        "start) is gone")
