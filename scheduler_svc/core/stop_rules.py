"""When a sequence stops: EOS or a stop token (after min_tokens), or its length limit."""
from __future__ import annotations

from dataclasses import dataclass

from protos import engine_pb2
from scheduler_svc.core.sequence import Sequence

STOP = engine_pb2.FINISH_REASON_STOP
LENGTH = engine_pb2.FINISH_REASON_LENGTH
UNFINISHED = engine_pb2.FINISH_REASON_UNSPECIFIED


@dataclass(frozen=True, slots=True)
class StopRule:
    """A sequence's stop conditions, resolved once when it is added, so checking a token is cheap."""

    token_ids: frozenset[int]  # EOS (unless ignore_eos) and the request's stop token ids
    min_tokens: int  # outputs before which those tokens do not stop it
    max_num_tokens: int  # total length at which it ends with LENGTH (max_tokens or the length limit)


def stop_rule_for(seq: Sequence, eos_token_ids: frozenset[int], max_seq_len: int) -> StopRule:
    stopping = seq.stopping
    token_ids = set(stopping.stop_token_ids)
    if not stopping.ignore_eos:
        token_ids |= eos_token_ids
    max_num_tokens = max_seq_len
    if stopping.max_tokens > 0:  # 0 means unset: only the length limit applies
        max_num_tokens = min(max_num_tokens, seq.num_prompt_tokens + stopping.max_tokens)
    return StopRule(frozenset(token_ids), stopping.min_tokens, max_num_tokens)


def stop_reason(seq: Sequence, rule: StopRule, token: int, num_tokens: int) -> int:
    """The finish reason once token is seq's num_tokens-th token (prompt included), or UNFINISHED."""
    if token in rule.token_ids and num_tokens - seq.num_prompt_tokens >= rule.min_tokens:
        return STOP
    if num_tokens >= rule.max_num_tokens:
        return LENGTH
    return UNFINISHED


def check_stop(seq: Sequence, rule: StopRule, token: int) -> int:
    """The finish reason after token was appended to seq, or UNFINISHED."""
    reason = stop_reason(seq, rule, token, len(seq.token_ids))
    if reason == STOP:
        seq.stop_token_id = token
    return reason
