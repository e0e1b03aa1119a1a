"""vLLM's worker protocol (`vllm.grpc.engine`, the stubs of the pinned smg-grpc-proto) written as
nanoserve.v1 and back: the SamplingParams of a vLLM GenerateRequest as a nanoserve.v1 request, which the
Generation service's own validation then checks, and a completion's deltas as vLLM's chunks and completes.

A field nanoserve cannot honour is INVALID_ARGUMENT naming it (as `sampling_params.<field>`), never
ignored. Fields with no effect on the tokens (skip_special_tokens, spaces_between_special_tokens) are
taken: SMG detokenizes itself. grammar_from_first_token holds trivially (no reasoning parser runs here).
"""
from __future__ import annotations

from dataclasses import dataclass

from smg_grpc_proto import vllm_engine_pb2 as vllm

from protos import engine_pb2, generation_pb2
from scheduler_svc.frontend.validation import InvalidArgument, check
from scheduler_svc.text.output_tracker import Delta, OutputTracker

INT32_MAX = 2**31 - 1
FINISH_REASONS = {
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_ABORT: "abort",
}  # FINISH_REASON_ERROR becomes a gRPC status, as in nanoserve.v1


@dataclass
class VllmRequest:
    """A vLLM GenerateRequest as nanoserve.v1, and what its answers need besides."""
    request: generation_pb2.GenerateRequest
    stream: bool
    top_logprobs: int | None  # None: no logprobs; k: the sampled token's and k candidates per token


def _unsupported(request: vllm.GenerateRequest) -> list[str]:
    """The fields of a request nanoserve cannot honour."""
    sp = request.sampling_params
    names = []
    if request.HasField("kv_transfer_params") or request.HasField("kv_transfer_params_json"):
        names.append("kv_transfer_params (prefill/decode disaggregation)")
    for field in ("mm_inputs", "media_refs"):
        if request.HasField(field):
            names.append(f"{field} (nanoserve serves text models)")
    if request.extra_mm_inputs:
        names.append("extra_mm_inputs (nanoserve serves text models)")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        names.append("data_parallel_rank (one data-parallel rank here)")
    if sp.HasField("prompt_logprobs"):
        names.append("sampling_params.prompt_logprobs")
    if sp.logit_bias:
        names.append("sampling_params.logit_bias")
    if sp.WhichOneof("constraint") == "structural_tag":
        names.append("sampling_params.structural_tag")
    return names


def to_generation_request(request: vllm.GenerateRequest) -> VllmRequest:
    """The request as nanoserve.v1 (unset vLLM fields at nanoserve's defaults); InvalidArgument for a field
    nanoserve cannot honour. Ranges are checked afterwards by validation.py, like any nanoserve.v1 request."""
    unsupported = _unsupported(request)
    check(not unsupported, "not supported by nanoserve: " + ", ".join(unsupported))
    sp = request.sampling_params
    out = generation_pb2.GenerateRequest(request_id=request.request_id)
    kind = request.WhichOneof("input")
    check(kind is not None, "one input is required: tokenized or text")
    if kind == "tokenized":
        ids = list(request.tokenized.input_ids)
        check(all(t <= INT32_MAX for t in ids), "tokenized.input_ids holds an id past 2^31")
        if sp.HasField("truncate_prompt_tokens"):
            keep = sp.truncate_prompt_tokens
            check(keep >= 1, f"sampling_params.truncate_prompt_tokens must be >= 1, got {keep}")
            ids = ids[-keep:]
        out.prompt_token_ids.ids.extend(ids)
    else:
        check(not sp.HasField("truncate_prompt_tokens"),
              "sampling_params.truncate_prompt_tokens needs tokenized input")
        out.prompt = request.text

    s = out.sampling
    if sp.HasField("temperature"):
        s.temperature = sp.temperature
    if sp.top_p:  # proto3 0 means unset: vLLM's default, 1.0
        s.top_p = sp.top_p
    check(sp.top_k <= INT32_MAX, f"sampling_params.top_k must be below 2^31, got {sp.top_k}")
    s.top_k, s.min_p = sp.top_k, sp.min_p
    s.presence_penalty, s.frequency_penalty = sp.presence_penalty, sp.frequency_penalty
    if sp.repetition_penalty:  # 0 means unset: 1.0
        s.repetition_penalty = sp.repetition_penalty
    if sp.HasField("max_tokens"):
        check(sp.max_tokens <= INT32_MAX, f"sampling_params.max_tokens must be below 2^31, got {sp.max_tokens}")
        s.max_tokens = sp.max_tokens
    check(sp.min_tokens <= INT32_MAX, f"sampling_params.min_tokens must be below 2^31, got {sp.min_tokens}")
    s.min_tokens = sp.min_tokens
    s.stop.extend(sp.stop)
    check(all(t <= INT32_MAX for t in sp.stop_token_ids), "sampling_params.stop_token_ids holds an id past 2^31")
    s.stop_token_ids.extend(sp.stop_token_ids)
    s.ignore_eos, s.include_stop_str_in_output = sp.ignore_eos, sp.include_stop_str_in_output
    if sp.n:
        check(sp.n <= INT32_MAX, f"sampling_params.n must be below 2^31, got {sp.n}")
        s.n = sp.n
    if sp.HasField("seed"):
        check(sp.seed >= 0, f"sampling_params.seed must be >= 0, got {sp.seed}")
        s.seed = sp.seed
    top_logprobs = None
    if sp.HasField("logprobs"):
        check(sp.logprobs >= 0, f"sampling_params.logprobs must be >= 0 (-1, every token's, is not supported), "
                                f"got {sp.logprobs}")
        top_logprobs = sp.logprobs
        s.logprobs = max(sp.logprobs, 1)  # nanoserve's 0 means none; vLLM's 0 means the sampled token's only
    constraint = sp.WhichOneof("constraint")
    if constraint == "choice":
        s.choice.choices.extend(sp.choice.choices)
    elif constraint is not None:
        setattr(s, constraint, getattr(sp, constraint))
    return VllmRequest(out, request.stream, top_logprobs)


def as_vllm_error(exc: InvalidArgument) -> str:
    """A validation message in vLLM's field names (nanoserve.v1 says sampling.x, vLLM sampling_params.x)."""
    message = str(exc)
    return "sampling_params." + message[len("sampling."):] if message.startswith("sampling.") else message


# ---------------------------------------------------------------- answers


def output_logprobs(delta: Delta, top: int) -> vllm.OutputLogProbs:
    out = vllm.OutputLogProbs(token_ids=delta.token_ids)
    for lp in delta.logprobs:
        out.token_logprobs.append(lp.sampled_logprob)
        out.top_logprobs.append(vllm.TopLogProbs(values=lp.top_logprobs[:top], token_ids=lp.top_token_ids[:top]))
    return out


class CompletionAnswer:
    """One completion (index) of a request, answered the vLLM way: with stream, a GenerateStreamChunk per
    delta and a GenerateComplete at the end; without, one GenerateComplete with every token."""

    def __init__(self, index: int, stream: bool, top_logprobs: int | None) -> None:
        self.index, self.stream, self.top = index, stream, top_logprobs
        self.token_ids: list[int] = []
        self.logprobs = vllm.OutputLogProbs()

    def answer(self, delta: Delta, tracker: OutputTracker) -> list[vllm.GenerateResponse]:
        counts = dict(prompt_tokens=tracker.num_prompt_tokens, completion_tokens=tracker.num_tokens,
                      cached_tokens=tracker.num_cached_tokens)
        logprobs = output_logprobs(delta, self.top) if self.top is not None else None
        answers = []
        if self.stream:
            if delta.token_ids:
                answers.append(vllm.GenerateResponse(chunk=vllm.GenerateStreamChunk(
                    token_ids=delta.token_ids, output_logprobs=logprobs, index=self.index, **counts)))
        else:
            self.token_ids.extend(delta.token_ids)
            if logprobs is not None:
                self.logprobs.MergeFrom(logprobs)
        if delta.finished:
            complete = vllm.GenerateComplete(finish_reason=FINISH_REASONS[delta.finish_reason], index=self.index,
                                             **counts)
            if not self.stream:  # a stream's tokens went in its chunks; SMG ignores them here
                complete.output_ids.extend(self.token_ids)
                if self.top is not None:
                    complete.output_logprobs.CopyFrom(self.logprobs)
            if isinstance(delta.stop_reason, str):
                complete.matched_stop_str = delta.stop_reason
            elif delta.stop_reason is not None:
                complete.matched_token_id = delta.stop_reason
            answers.append(vllm.GenerateResponse(complete=complete))
        return answers
