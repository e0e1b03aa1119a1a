"""Rank 0's wait for a step's late token masks (structured output under async scheduling).

A constrained sequence planned while its previous token was still in flight gets its mask after the plan:
the scheduler fills it once it has applied the step before, which rank 0 answered just now. Rank 0 launches
the step's forward first and waits only before sampling it, so the wait overlaps the forward on a GPU.

The wait reads the step loop's socket. Whatever else arrives meanwhile (the next plan, with more than two
steps in flight) is kept, in order, for the loop. Masks of an earlier step (one that failed here, so was
never waited for) are dropped. The wait is bounded: a scheduler that is gone, or one that asks for a new
handshake or a shutdown meanwhile, never leaves rank 0 waiting; the step then fails like any executor error.
Torch-free.
"""
from __future__ import annotations

import logging
import time
from collections import deque

import zmq
from google.protobuf.message import DecodeError

from executor_svc.seq_mirror import ScheduledChunk, attach_late_masks
from protos import engine_pb2

log = logging.getLogger("nanoserve.executor")


class LateMaskError(RuntimeError):
    """The step's late masks did not come, or did not fit: the step fails (its token masks are unknown)."""


def wait_late_masks(sock: zmq.Socket, epoch: int, step_id: int, chunks: list[ScheduledChunk], timeout_s: float,
                    backlog: deque) -> None:
    """Read the socket until step step_id's LateTokenMasks (of this epoch) come, and give its chunks their
    masks. Other messages go to backlog for the step loop. Raises LateMaskError after timeout_s, when the
    scheduler turns to a handshake or a shutdown, or when the masks do not answer the step's late chunks."""
    deadline = time.monotonic() + timeout_s
    while True:
        left_ms = (deadline - time.monotonic()) * 1e3
        if left_ms <= 0 or not sock.poll(max(1, int(left_ms))):
            raise LateMaskError(f"the late token masks of step {step_id} did not come within {timeout_s:g}s")
        try:
            msg = engine_pb2.SchedulerToExecutor.FromString(sock.recv())
        except DecodeError as exc:
            log.error("dropped a malformed message while waiting for late token masks: %s", exc)
            continue
        kind = msg.WhichOneof("kind")
        if kind != "late_masks":
            if kind is not None:  # an empty envelope is a liveness probe
                backlog.append(msg)
            if kind in ("handshake_request", "shutdown"):
                raise LateMaskError(f"the scheduler turned to a {kind} while step {step_id} waited for its late "
                                    "token masks")
            continue
        if msg.epoch != epoch or msg.late_masks.step_id < step_id:
            continue  # another scheduler's, or a step that failed here before it waited
        if msg.late_masks.step_id > step_id:
            raise LateMaskError(f"late token masks of step {msg.late_masks.step_id} came while step {step_id} "
                                "waited for its own")
        try:
            attach_late_masks(msg.late_masks, chunks)
        except RuntimeError as exc:
            raise LateMaskError(str(exc)) from exc
        return
