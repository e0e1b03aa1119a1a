"""The scheduler and executors are OS processes apart from the caller, and none outlives it:
not after close(), not after an exception, not after Ctrl-C, not after the caller is SIGKILLed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from support.tiny_checkpoints import tiny_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next(line for line in f if line.startswith("State:"))
        return "Z" not in state.split()[1]  # a zombie has already exited
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_all_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return tiny_checkpoint("llama", tmp_path_factory)


def test_engine_roles_are_separate_processes_and_close_leaves_none(model):
    from scheduler_svc.entrypoints.llm import LLM

    llm = LLM(model)
    procs = llm.processes
    pids = [p.pid for p in procs.all()]
    assert len(pids) == 2 and os.getpid() not in pids
    assert all(alive(p) for p in pids)
    out = llm.generate([[1, 2, 3]], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0
    llm.close()
    assert wait_all_gone(pids) == []


CHILD = textwrap.dedent("""
    import faulthandler, os, signal, sys, time
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for the stacks of a caller that hangs
    # Ctrl-C as at a terminal: a test run in a shell's background job inherits SIGINT ignored, and Python keeps
    # an ignored SIGINT ignored (so the caller slept through the signal in such a CI run)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {repo!r})
    from scheduler_svc.entrypoints.llm import LLM
    from scheduler_svc.frontend.sampling_params import SamplingParams
    llm = LLM({model!r})
    print("PIDS", *[p.pid for p in llm.processes.all()], flush=True)
    mode = {mode!r}
    if mode == "exception":
        raise RuntimeError("boom")
    # keep the engine busy so the signal lands mid-generation
    llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
    time.sleep(60)
""")


def start_child(model: str, mode: str, stderr) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(repo=REPO, model=model, mode=mode)],
                            stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO)
    for line in proc.stdout:
        if line.startswith("PIDS"):
            return proc, [int(p) for p in line.split()[1:]]
    proc.wait()
    raise AssertionError(f"child exited with {proc.returncode} before starting the engine")


def wait_exit(proc: subprocess.Popen, stderr, timeout: float) -> int:
    """The caller's exit code; if it has not exited within timeout, fail with its threads' stacks and the end
    of its log (a caller that hangs on its way out is the bug this file guards against)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        proc.kill()
        proc.wait()
        stderr.seek(0)
        raise AssertionError(f"the caller did not exit within {timeout:g}s; its stderr ends:\n"
                             + stderr.read().decode(errors="replace")[-6000:]) from None


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT", "SIGTERM"])
def test_no_child_process_survives_a_killed_caller(model, how, tmp_path):
    with open(tmp_path / "caller.stderr", "w+b") as stderr:
        proc, pids = start_child(model, "busy", stderr)
        time.sleep(1.0)
        proc.send_signal(getattr(signal, how))
        wait_exit(proc, stderr, 30)
    assert wait_all_gone(pids) == [], f"orphans after {how}"


def test_no_child_process_survives_an_exception_in_the_caller(model, tmp_path):
    with open(tmp_path / "caller.stderr", "w+b") as stderr:
        proc, pids = start_child(model, "exception", stderr)
        assert wait_exit(proc, stderr, 30) != 0
    assert wait_all_gone(pids) == []


WATCHED = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from scheduler_svc.common.parent_watch import watch_parent
    watch_parent({parent_pid})
    print("watching", flush=True)
    time.sleep(30)
""")


def test_a_role_whose_named_launcher_died_while_it_started_exits_at_once():
    """A launcher SIGKILLed while its children still import (seconds, with torch) has handed them to init
    before they look: they must go by the pid they were given, not by the parent they find (CI once kept a
    SIGKILLed serve's scheduler and executor running for the rest of the suite)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    orphan = subprocess.run([sys.executable, "-c", WATCHED.format(repo=REPO, parent_pid=gone.pid)], cwd=REPO,
                            capture_output=True, text=True, timeout=20)
    assert orphan.returncode == 1 and "watching" not in orphan.stdout
    kept = subprocess.Popen([sys.executable, "-c", WATCHED.format(repo=REPO, parent_pid=os.getpid())], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert kept.stdout.readline().strip() == "watching"  # its launcher (this process) lives: it stays
        assert kept.poll() is None
    finally:
        kept.kill()
        kept.wait()
