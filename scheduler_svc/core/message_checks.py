"""What the scheduler checks of every message at its boundary, before any of it touches its state.

A front end or an executor may be buggy, outdated or hostile: a message that breaks a rule is
rejected with a reason (logged with the peer's identity and counted), never half-applied. The public
API's validator (frontend/validation.py) gives the friendly messages; these checks are the engine's
own, so nothing a peer sends can crash the scheduler or reach the executors out of range.
"""
from __future__ import annotations

import logging
import math
import struct

from protos import engine_pb2
from scheduler_svc.core.structured.grammars import MAX_CONSTRAINT_BYTES

log = logging.getLogger("nanoserve.scheduler")

MAX_ID_LENGTH = 512  # request and group ids
MAX_LOGPROBS = 1024
MAX_BEAM_WIDTH = 1024
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
MAX_STEP_SECONDS = 1e6  # a step's timings beyond this (or negative, or not finite) are no times at all
STEP_TIMING_FIELDS = ("execute_seconds", "idle_seconds", "late_mask_wait_seconds", "swap_seconds")


class BadMessage(ValueError):
    """A message the scheduler will not apply; the text says why."""


def _require(ok: bool, reason: str) -> None:
    if not ok:
        raise BadMessage(reason)


def as_float32(x: float) -> float:
    """x rounded to the wire's 32-bit float: 1e39 becomes inf there, 1e-46 becomes 0."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _finite(name: str, value: float, low: float, high: float, float32: bool = False) -> None:
    """float32: a 32-bit field, whose bounds are compared rounded alike, so that 0.01 accepts itself (as the
    front end's validator does; a double bound refused a float32 0.01 that the front end had let through)."""
    if float32:
        low, high = as_float32(low), as_float32(high)
    _require(math.isfinite(value) and low <= value <= high, f"{name} = {value} is not in [{low}, {high}]")


def check_add_request(add: engine_pb2.AddRequest, vocab_size: int, max_num_seqs: int) -> None:
    """Raise BadMessage unless every field of the request is in range for this engine."""
    _require(0 < len(add.request_id) <= MAX_ID_LENGTH, f"request_id must have 1 to {MAX_ID_LENGTH} characters")
    _require(len(add.group_id) <= MAX_ID_LENGTH, f"group_id has more than {MAX_ID_LENGTH} characters")
    _require(len(add.client_request_id) <= MAX_ID_LENGTH,
             f"client_request_id has more than {MAX_ID_LENGTH} characters")
    ids = add.prompt_token_ids
    _require(len(ids) > 0, "prompt_token_ids is empty")
    _require(min(ids) >= 0 and max(ids) < vocab_size, f"prompt_token_ids outside the vocabulary [0, {vocab_size})")
    s = add.sampling
    _finite("sampling.temperature", s.temperature, 0.0, FLOAT32_MAX, float32=True)  # any finite one: the validator's
    _finite("sampling.top_p", s.top_p, 0.0, 1.0, float32=True)  # 0 is the wire's unset value: off
    _finite("sampling.min_p", s.min_p, 0.0, 1.0, float32=True)
    _require(0 <= s.top_k <= vocab_size, f"sampling.top_k must be in [0, {vocab_size}]")
    _require(0 <= s.logprobs <= MAX_LOGPROBS, f"sampling.logprobs must be in [0, {MAX_LOGPROBS}]")
    _finite("sampling.presence_penalty", s.presence_penalty, -100.0, 100.0, float32=True)
    _finite("sampling.frequency_penalty", s.frequency_penalty, -100.0, 100.0, float32=True)
    # 0 is the wire's unset value (no penalty); otherwise its reciprocal must stay a sane float32
    _require(s.repetition_penalty == 0 or as_float32(0.01) <= s.repetition_penalty <= 100.0,
             f"sampling.repetition_penalty = {s.repetition_penalty} is not 0 (off) or in [0.01, 100]")
    _require(math.isfinite(s.repetition_penalty), "sampling.repetition_penalty is not finite")
    st = add.stopping
    _require(st.max_tokens >= 0, f"stopping.max_tokens = {st.max_tokens} is negative (0 means no limit)")
    _require(st.min_tokens >= 0, f"stopping.min_tokens = {st.min_tokens} is negative")
    _require(all(0 <= t < vocab_size for t in st.stop_token_ids),
             f"stopping.stop_token_ids outside the vocabulary [0, {vocab_size})")
    if add.HasField("constraint"):
        _require(add.constraint.WhichOneof("kind") is not None, "constraint is set but empty")
        _require(add.constraint.ByteSize() <= MAX_CONSTRAINT_BYTES,
                 f"constraint is {add.constraint.ByteSize()} bytes; the limit is {MAX_CONSTRAINT_BYTES}")
        _require(not add.beam_search.beam_width, "constraint: structured output does not apply to beam search")
    beam = add.beam_search
    if beam.beam_width:
        _require(0 < beam.beam_width <= min(MAX_BEAM_WIDTH, max_num_seqs),
                 f"beam_search.beam_width must be in [1, {min(MAX_BEAM_WIDTH, max_num_seqs)}]")
        _finite("beam_search.length_penalty", beam.length_penalty, -100.0, 100.0, float32=True)
        _require(bool(add.group_id), "a beam search request needs a group_id")


def check_handshake(hs: engine_pb2.ExecutorHandshake, identity: bytes, world_size: int, block_size: int) -> None:
    """Raise BadMessage unless the handshake describes a rank of this engine, from that rank's socket."""
    _require(hs.world_size == world_size, f"world_size {hs.world_size}, but the scheduler serves {world_size}")
    _require(0 <= hs.rank < world_size, f"rank {hs.rank} is outside [0, {world_size})")
    _require(identity == f"rank{hs.rank}".encode(), f"rank {hs.rank}'s handshake came from socket {identity!r}")
    _require(hs.block_size == block_size, f"block_size {hs.block_size}, but the scheduler uses {block_size}")
    _require(0 < hs.num_blocks <= INT32_MAX, f"num_blocks = {hs.num_blocks} must be positive")
    _require(hs.num_host_blocks >= 0, f"num_host_blocks = {hs.num_host_blocks} is negative")
    _require(hs.vocab_size > 0, f"vocab_size = {hs.vocab_size} must be positive")
    _require(hs.max_position_embeddings > 1, f"max_position_embeddings = {hs.max_position_embeddings} is too small")
    _require(all(0 <= t < hs.vocab_size for t in hs.eos_token_ids), "eos_token_ids outside the vocabulary")
    _require(hs.kv_block_bytes >= 0, f"kv_block_bytes = {hs.kv_block_bytes} is negative")
    _finite("host_link_bytes_per_s", hs.host_link_bytes_per_s, 0.0, 1e15)  # 0: not measured
    _finite("copy_fixed_seconds", hs.copy_fixed_seconds, 0.0, 1.0)
    _finite("prefill_tokens_per_s", hs.prefill_tokens_per_s, 0.0, 1e12)


def check_heartbeat(hb: engine_pb2.Heartbeat, identity: bytes, world_size: int) -> None:
    _require(0 <= hb.rank < world_size, f"heartbeat for rank {hb.rank}, outside [0, {world_size})")
    _require(identity == f"rank{hb.rank}-hb".encode(), f"rank {hb.rank}'s heartbeat came from socket {identity!r}")


def check_step_result(result: engine_pb2.StepResult, identity: bytes, in_flight_step_ids: set[int]) -> None:
    """Only rank 0 replies, and only to a step this scheduler has in flight; its timings are made times."""
    _require(identity == b"rank0", f"a step result came from socket {identity!r}, not rank 0's")
    _require(result.step_id in in_flight_step_ids, f"step {result.step_id} is not in flight")
    # Timings only feed stats and the preemption cost model, while the tokens are what clients wait for:
    # a bad time is zeroed, not the result dropped (which would leave the step in flight until the timeout).
    for name in STEP_TIMING_FIELDS:
        value = getattr(result, name)
        if not (math.isfinite(value) and 0.0 <= value <= MAX_STEP_SECONDS):
            log.warning("step %d: rank 0 reported %s = %r, not a time: counted as 0", result.step_id, name, value)
            setattr(result, name, 0.0)
