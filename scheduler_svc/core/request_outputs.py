"""What the scheduler tells front ends about their requests: the RequestOutput messages of a step, of an
ended request, and of a refused one."""
from __future__ import annotations

from protos import engine_pb2
from scheduler_svc.core.scheduler_output import StepUpdate
from scheduler_svc.core.sequence import Sequence

UNFINISHED = engine_pb2.FINISH_REASON_UNSPECIFIED
ERROR = engine_pb2.FINISH_REASON_ERROR


def refused(add: engine_pb2.AddRequest, reason: str) -> engine_pb2.RequestOutput:
    """The one terminal output of a request the scheduler would not take."""
    return engine_pb2.RequestOutput(request_id=add.request_id, finish_reason=ERROR, error=reason, stop_token_id=-1,
                                    num_prompt_tokens=len(add.prompt_token_ids))


def ended(seq: Sequence, reason: int, error: str) -> engine_pb2.RequestOutput:
    """The one terminal output of a request ended outside a step (aborted, or failed)."""
    return engine_pb2.RequestOutput(request_id=seq.request_id, finish_reason=reason, error=error, stop_token_id=-1,
                                    num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
                                    num_proposed_tokens=seq.num_proposed_tokens,
                                    num_accepted_tokens=seq.num_accepted_tokens)


def step_outputs(updates: list[StepUpdate], sampled: dict[int, engine_pb2.SampledToken]
                 ) -> dict[bytes, engine_pb2.StepOutputs]:
    """One StepOutputs per front end, with an output for each of its requests that has news."""
    by_frontend: dict[bytes, engine_pb2.StepOutputs] = {}
    for update in updates:
        seq = update.seq
        if update.new_token_id is None and update.finish_reason == UNFINISHED:
            continue  # a prefill chunk that did not reach the end: nothing to say yet
        out = engine_pb2.RequestOutput(
            request_id=seq.request_id, finish_reason=update.finish_reason, stop_token_id=seq.stop_token_id,
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens, error=update.error)
        if update.finish_reason != UNFINISHED and seq.num_proposed_tokens:
            out.num_proposed_tokens, out.num_accepted_tokens = seq.num_proposed_tokens, seq.num_accepted_tokens
        if update.new_token_id is not None:
            if update.accepted_token_ids:  # speculative decoding: accepted proposals come first
                out.new_token_ids.extend(update.accepted_token_ids)
            out.new_token_ids.append(update.new_token_id)
            token = sampled.get(seq.seq_id)
            if token is not None and token.HasField("logprobs"):
                out.logprobs.append(token.logprobs)
        elif seq.beam_options is not None:
            out.new_token_ids.extend(seq.output_token_ids)  # a beam search's hypothesis, whole
            out.logprobs.extend(engine_pb2.TokenLogprobs(
                sampled_logprob=lp, sampled_rank=rank, top_token_ids=ids, top_logprobs=lps)
                for lp, rank, ids, lps in seq.beam_logprobs)
        by_frontend.setdefault(seq.reply_to, engine_pb2.StepOutputs()).outputs.append(out)
    return by_frontend
