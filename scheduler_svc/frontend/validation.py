"""Public requests checked and turned into what the engine runs: prompt token ids and SamplingParams.

Every rejection is an InvalidArgument whose message names the field and the limit, so the client
can fix the request without reading the server's logs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from protos import engine_pb2, generation_pb2
from scheduler_svc.frontend.sampling_params import SamplingParams
from scheduler_svc.frontend.server_config import RequestLimits
from scheduler_svc.text.tokenizer import Tokenizer

MAX_REQUEST_ID_LENGTH = 256


class InvalidArgument(ValueError):
    """The request is wrong; the message says which field and why."""


@dataclass
class ValidRequest:
    prompt_token_ids: list[int]
    params: SamplingParams


def check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgument(message)


def _need_tokenizer(tokenizer: Tokenizer | None, field: str) -> Tokenizer:
    check(tokenizer is not None, f"{field}: this model has no tokenizer; send prompt_token_ids instead")
    return tokenizer


def chat_token_ids(messages: generation_pb2.ChatMessages, tokenizer: Tokenizer | None, field: str,
                   add_generation_prompt: bool = True) -> list[int]:
    tokenizer = _need_tokenizer(tokenizer, field)
    check(len(messages.messages) > 0, f"{field}.messages is empty")
    for i, m in enumerate(messages.messages):
        check(bool(m.role), f"{field}.messages[{i}].role is empty")
    try:
        return tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in messages.messages],
                                     add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # the template raises on roles or orders it does not accept
        raise InvalidArgument(f"{field}: {exc}") from exc


def check_token_ids(ids, vocab_size: int, field: str) -> None:
    for i, t in enumerate(ids):
        check(0 <= t < vocab_size, f"{field}[{i}] = {t} is outside the vocabulary [0, {vocab_size})")


def prompt_token_ids(request: generation_pb2.GenerateRequest, tokenizer: Tokenizer | None,
                     vocab_size: int) -> list[int]:
    kind = request.WhichOneof("input")
    check(kind is not None, "one input is required: prompt, prompt_token_ids or messages")
    if kind == "prompt":
        check(len(request.prompt) > 0, "prompt is empty")
        ids = _need_tokenizer(tokenizer, "prompt").encode(request.prompt)
    elif kind == "prompt_token_ids":
        ids = list(request.prompt_token_ids.ids)
        check(len(ids) > 0, "prompt_token_ids.ids is empty")
    else:
        ids = chat_token_ids(request.messages, tokenizer, "messages")
    check(len(ids) > 0, f"{kind} is empty after tokenization")
    check_token_ids(ids, vocab_size, "prompt_token_ids.ids")
    return ids


def sampling_params(sp: generation_pb2.SamplingParams, limits: RequestLimits, vocab_size: int,
                    room: int) -> SamplingParams:
    """room: how many tokens fit after the prompt within max_model_len."""
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "length_penalty"):
        value = getattr(sp, name)
        check(math.isfinite(value), f"sampling.{name} must be a finite number, got {value}")
    check(len(sp.stop) <= limits.max_stop_strings,
          f"sampling.stop has {len(sp.stop)} strings; the limit is {limits.max_stop_strings}")
    for i, s in enumerate(sp.stop):
        check(0 < len(s) <= limits.max_stop_string_length,
              f"sampling.stop[{i}] has {len(s)} characters; it must have 1 to {limits.max_stop_string_length}")
    check_token_ids(sp.stop_token_ids, vocab_size, "sampling.stop_token_ids")
    if sp.HasField("max_tokens"):
        check(sp.max_tokens <= room,
              f"sampling.max_tokens = {sp.max_tokens} does not fit: prompt tokens + max_tokens must be "
              f"<= max_model_len, which leaves room for {room}")
    params = SamplingParams(
        temperature=sp.temperature if sp.HasField("temperature") else 1.0,
        top_p=sp.top_p if sp.HasField("top_p") else 1.0,
        top_k=sp.top_k, min_p=sp.min_p,
        seed=sp.seed if sp.HasField("seed") else None,
        max_tokens=sp.max_tokens if sp.HasField("max_tokens") else min(limits.default_max_tokens, room),
        min_tokens=sp.min_tokens, stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos, include_stop_str_in_output=sp.include_stop_str_in_output,
        n=sp.n if sp.HasField("n") else 1, logprobs=sp.logprobs,
        presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else 1.0,
        beam_width=sp.beam_width,
        length_penalty=sp.length_penalty if sp.HasField("length_penalty") else 1.0,
    )
    try:
        params.validate(max_n=limits.max_n, max_logprobs=limits.max_logprobs, max_stop=limits.max_stop_strings,
                        max_stop_len=limits.max_stop_string_length,
                        max_beam_width=limits.max_beam_width)
    except ValueError as exc:
        raise InvalidArgument(f"sampling.{exc}") from exc
    return params


def validate_generate(request: generation_pb2.GenerateRequest, tokenizer: Tokenizer | None,
                      ready: engine_pb2.EngineReady, limits: RequestLimits) -> ValidRequest:
    check(len(request.request_id) <= MAX_REQUEST_ID_LENGTH,
          f"request_id has {len(request.request_id)} characters; the limit is {MAX_REQUEST_ID_LENGTH}")
    vocab_size, max_model_len = ready.model.vocab_size, ready.max_model_len
    ids = prompt_token_ids(request, tokenizer, vocab_size)
    check(len(ids) < max_model_len,
          f"the prompt has {len(ids)} tokens; it must be shorter than max_model_len = {max_model_len}")
    kv_tokens = ready.model.num_blocks * ready.model.block_size
    check(len(ids) < kv_tokens, f"the prompt has {len(ids)} tokens; the KV cache holds {kv_tokens}")
    params = sampling_params(request.sampling, limits, vocab_size, room=max_model_len - len(ids))
    return ValidRequest(ids, params)
