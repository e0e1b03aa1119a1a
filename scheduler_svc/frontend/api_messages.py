"""Engine facts and tracker deltas written as the public nanoserve.v1 messages."""
from __future__ import annotations

from typing import Iterable

from protos import engine_pb2, generation_pb2
from scheduler_svc.text.output_tracker import Delta, OutputTracker

FINISH_REASONS = {
    engine_pb2.FINISH_REASON_UNSPECIFIED: generation_pb2.FINISH_REASON_UNSPECIFIED,
    engine_pb2.FINISH_REASON_STOP: generation_pb2.FINISH_REASON_STOP,
    engine_pb2.FINISH_REASON_LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    engine_pb2.FINISH_REASON_ABORT: generation_pb2.FINISH_REASON_ABORT,
}  # FINISH_REASON_ERROR never reaches a message: it becomes a gRPC status


def token_logprob(token_id: int, lp: engine_pb2.TokenLogprobs) -> generation_pb2.TokenLogprob:
    return generation_pb2.TokenLogprob(
        token_id=token_id, logprob=lp.sampled_logprob, rank=lp.sampled_rank,
        top_logprobs=[generation_pb2.TopLogprob(token_id=t, logprob=p)
                      for t, p in zip(lp.top_token_ids, lp.top_logprobs)])


def completion_output(index: int, delta: Delta) -> generation_pb2.CompletionOutput:
    out = generation_pb2.CompletionOutput(
        index=index, text=delta.text, token_ids=delta.token_ids,
        logprobs=[token_logprob(t, lp) for t, lp in zip(delta.token_ids, delta.logprobs)],
        finish_reason=FINISH_REASONS[delta.finish_reason])
    if isinstance(delta.stop_reason, str):
        out.stop_string = delta.stop_reason
    elif delta.stop_reason is not None:
        out.stop_token_id = delta.stop_reason
    return out


def usage(num_prompt_tokens: int, trackers: Iterable[OutputTracker]) -> generation_pb2.Usage:
    """Token counts of a request; the n completions share one prompt."""
    trackers = list(trackers)
    return generation_pb2.Usage(prompt_tokens=num_prompt_tokens,
                                completion_tokens=sum(t.num_tokens for t in trackers),
                                cached_prompt_tokens=max(t.num_cached_tokens for t in trackers),
                                speculative_proposed_tokens=sum(t.num_proposed_tokens for t in trackers),
                                speculative_accepted_tokens=sum(t.num_accepted_tokens for t in trackers))


def merge_output(total: generation_pb2.CompletionOutput, part: generation_pb2.CompletionOutput) -> None:
    """Append a streamed delta to the whole completion (the unary Generate)."""
    total.text += part.text
    total.token_ids.extend(part.token_ids)
    total.logprobs.extend(part.logprobs)
    if part.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
        total.finish_reason = part.finish_reason
    kind = part.WhichOneof("stop_reason")
    if kind is not None:
        setattr(total, kind, getattr(part, kind))


def model_info(ready: engine_pb2.EngineReady) -> generation_pb2.ModelInfo:
    m = ready.model
    return generation_pb2.ModelInfo(
        model_name=m.model_name, architecture=m.architecture, max_model_len=ready.max_model_len,
        vocab_size=m.vocab_size, eos_token_ids=m.eos_token_ids, dtype=m.dtype, device=m.device,
        block_size=m.block_size, tensor_parallel_size=m.world_size, num_kv_blocks=m.num_blocks,
        attention_backend=m.attention_backend, kv_cache_dtype=m.kv_cache_dtype, max_num_seqs=ready.max_num_seqs,
        weight_format=m.weight_format)


def stats(s: engine_pb2.SchedulerStats) -> generation_pb2.Stats:
    names = set(generation_pb2.Stats.DESCRIPTOR.fields_by_name)
    names &= set(engine_pb2.SchedulerStats.DESCRIPTOR.fields_by_name)
    out = generation_pb2.Stats(**{name: getattr(s, name) for name in names})
    if s.num_speculative_steps:  # each verifying step yields its accepted proposals and one token more
        out.mean_accepted_length = 1 + s.num_accepted_tokens / s.num_speculative_steps
    return out
