"""What the scheduler does with each message from a front end: heartbeats, new requests, aborts, stats
queries; and how it tells a front end that one of its requests ended.

These are functions of the EngineCore they are given (FrontendHost): it owns the scheduler, the transport
and the front ends' liveness, and calls them on its one thread, so the scheduler keeps a single writer
(invariant 1). Nothing here holds state of its own.
"""
from __future__ import annotations

import time
from typing import Protocol

from google.protobuf.message import DecodeError

from protos import engine_pb2
from scheduler_svc.common.config import EngineConfig
from scheduler_svc.core import request_outputs
from scheduler_svc.core.executor_registry import ExecutorRegistry
from scheduler_svc.core.message_checks import BadMessage, check_add_request
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.sequence import Sequence
from scheduler_svc.core.speculative.speculator import can_speculate


class FrontendHost(Protocol):
    """What front-end requests read and change of the scheduler process (engine_core.py's EngineCore)."""

    config: EngineConfig
    scheduler: Scheduler | None  # None until every executor rank has shaken hands
    ready: engine_pb2.EngineReady | None
    executors: ExecutorRegistry
    world_size: int
    handshake_refused: str
    frontends: dict[bytes, float]  # identity -> when it was last heard from (monotonic)

    def to_frontend(self, identity: bytes, msg: engine_pb2.SchedulerToFrontend) -> None:
        """Send to a front end, stamped with this process's epoch."""

    def reject_message(self, identity: bytes, reason: str) -> None:
        """Drop a bad message: logged and counted."""

    def stats(self, query_id: int) -> engine_pb2.SchedulerStats:
        """The answer to a stats query."""

    def follow_kv_events(self, identity: bytes, wanted: bool) -> None:
        """Start (with a snapshot) or end a front end's subscription to the prefix index's changes."""


def on_frontend(core: FrontendHost, identity: bytes, payload: bytes) -> None:
    try:
        msg = engine_pb2.FrontendToScheduler.FromString(payload)
    except DecodeError as exc:
        return core.reject_message(identity, f"not a FrontendToScheduler: {exc}")
    kind = msg.WhichOneof("kind")
    if kind is None:
        return core.reject_message(identity, "a FrontendToScheduler with no message in it")
    core.frontends[identity] = time.monotonic()
    if kind == "hello":  # a heartbeat: the answer is the front end's heartbeat from us
        answer = engine_pb2.SchedulerToFrontend()
        if core.ready is not None:
            answer.ready.CopyFrom(core.ready)
        else:
            answer.not_ready.CopyFrom(engine_pb2.NotReady(num_executors=len(core.executors.handshakes),
                                                          world_size=core.world_size,
                                                          refused=core.handshake_refused))
        core.to_frontend(identity, answer)
        core.follow_kv_events(identity, msg.hello.kv_events)
    elif kind == "add":
        _add_request(core, identity, msg.add)
    elif kind == "abort":
        _abort_requests(core, identity, msg.abort)
    elif kind == "stats":
        core.to_frontend(identity, engine_pb2.SchedulerToFrontend(stats=core.stats(msg.stats.query_id)))


def _add_request(core: FrontendHost, identity: bytes, add: engine_pb2.AddRequest) -> None:
    if core.scheduler is None:
        return _reject(core, identity, add, "engine not ready: executors have not finished their handshake")
    try:
        check_add_request(add, core.ready.model.vocab_size, core.config.max_num_seqs)
    except BadMessage as exc:
        core.reject_message(identity, f"AddRequest {add.request_id[:64]!r}: {exc}")
        return _reject(core, identity, add, f"rejected by the scheduler: {exc}")
    seq = Sequence(
        seq_id=core.scheduler.new_seq_id(), request_id=add.request_id, token_ids=list(add.prompt_token_ids),
        num_prompt_tokens=len(add.prompt_token_ids), sampling=add.sampling, stopping=add.stopping,
        priority=add.priority, group_id=add.group_id, reply_to=identity, client_request_id=add.client_request_id,
        beam_options=add.beam_search if add.beam_search.beam_width > 0 else None,
        constraint=add.constraint if add.HasField("constraint") else None, speculate=can_speculate(add),
    )
    try:
        core.scheduler.add(seq)
    except ValueError as exc:
        _reject(core, identity, add, str(exc))


def _reject(core: FrontendHost, identity: bytes, add: engine_pb2.AddRequest, reason: str) -> None:
    _tell(core, identity, request_outputs.refused(add, reason))


def _abort_requests(core: FrontendHost, identity: bytes, abort_msg: engine_pb2.AbortRequests) -> None:
    for request_id in abort_msg.request_ids:
        abort(core, identity, request_id, engine_pb2.FINISH_REASON_ABORT)
    found = set()
    if abort_msg.client_request_ids and core.scheduler is not None:
        wanted = set(abort_msg.client_request_ids)  # a scan: aborts are rare, the running set is small
        for seq in [s for s in core.scheduler.requests.values() if s.client_request_id in wanted]:
            found.add(seq.client_request_id)
            abort(core, seq.reply_to, seq.request_id, engine_pb2.FINISH_REASON_ABORT)
    if abort_msg.query_id:
        core.to_frontend(identity, engine_pb2.SchedulerToFrontend(aborted=engine_pb2.AbortedRequests(
            query_id=abort_msg.query_id, client_request_ids=sorted(found))))


def abort(core: FrontendHost, identity: bytes, request_id: str, reason: int, error: str = "") -> None:
    """End a front end's request now with one terminal output (invariant 7); unknown or finished ids
    are ignored."""
    seq = core.scheduler.abort(request_id, identity) if core.scheduler is not None else None
    if seq is not None:
        tell_ended(core, seq, reason, error)


def tell_ended(core: FrontendHost, seq: Sequence, reason: int, error: str) -> None:
    _tell(core, seq.reply_to, request_outputs.ended(seq, reason, error))


def _tell(core: FrontendHost, identity: bytes, out: engine_pb2.RequestOutput) -> None:
    core.to_frontend(identity, engine_pb2.SchedulerToFrontend(outputs=engine_pb2.StepOutputs(outputs=[out])))
