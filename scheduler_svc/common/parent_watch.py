"""A child role dies with the process that started it: it asks the kernel for SIGKILL when its parent
dies (PR_SET_PDEATHSIG), and a watcher thread covers a parent that died before that was armed."""
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


def watch_parent() -> None:
    """In a child role: exit when the process that started us is gone (backs up PR_SET_PDEATHSIG),
    and leave Ctrl-C to the parent, which owns shutdown."""
    import threading
    import time

    parent_pid = os.getppid()
    die_with_parent()

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=watch, daemon=True, name="watch-parent").start()
