"""Every check of a request against the engine's facts and the request limits, in one place.

The gRPC service (validate_generate) and the offline LLM (validate_request) run the same checks and
raise the same InvalidArgument. Its message names the field as nanoserve.v1 spells it
("sampling.top_p", "prompt_token_ids.ids[3]") and the limit, so the caller can fix the request
without reading the server's logs; the gRPC service answers it as INVALID_ARGUMENT (invariant 8).
Every number it passes reaches the executor finite and in range as a 32-bit float: a repetition_penalty
of 1e-45 was inside (0, 10] once, and the executor's logits / penalty overflowed to inf.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

from protos import engine_pb2, generation_pb2
from scheduler_svc.core.message_checks import as_float32
from scheduler_svc.core.structured.grammar_threads import GrammarBusy
from scheduler_svc.core.structured.grammars import MAX_CONSTRAINT_BYTES, grammar_error
from scheduler_svc.frontend.sampling_params import SamplingParams, from_api
from scheduler_svc.frontend.server_config import RequestLimits
from scheduler_svc.text.tokenizer import Tokenizer

MAX_REQUEST_ID_LENGTH = 256
INT32_END = 2**31  # the wire's int32 fields hold values below this


class InvalidArgument(ValueError):
    """The request is wrong; the message says which field and why."""


class Overloaded(Exception):
    """The request may be right but cannot be checked now (the gRPC service answers RESOURCE_EXHAUSTED)."""


@dataclass
class ValidRequest:
    prompt_token_ids: list[int]
    params: SamplingParams  # max_tokens is always set


def check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgument(message)


# ---------------------------------------------------------------- numbers as the executor sees them


@dataclass(frozen=True)
class Interval:
    low: float
    high: float = math.inf
    low_open: bool = False
    why: str = ""  # said in the message when the bound is not the obvious one

    def holds(self, x: float) -> bool:
        """Compared in float32, the bounds rounded too, so a bound such as 0.01 accepts itself."""
        low, x = as_float32(self.low), as_float32(x)
        return (low < x if self.low_open else low <= x) and x <= as_float32(self.high)

    def __str__(self) -> str:
        if self.high == math.inf:
            return f">= {self.low:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


FLOAT_RANGES = {
    "temperature": Interval(0),
    "top_p": Interval(0, 1, low_open=True),
    "min_p": Interval(0, 1),
    "presence_penalty": Interval(-2, 2),
    "frequency_penalty": Interval(-2, 2),
    "repetition_penalty": Interval(0.01, 10, why=" (the executor divides logits by it; a smaller one overflows)"),
    "length_penalty": Interval(-10, 10),
}
INT_FIELDS = ("top_k", "min_tokens", "n", "logprobs", "beam_width")
OPTIONAL_INT_FIELDS = ("max_tokens", "seed")  # None means unset


def _check_types(p: SamplingParams) -> None:
    """The offline LLM takes any Python value; the wire takes numbers and strings of its field's type."""
    for name in FLOAT_RANGES:
        value = getattr(p, name)
        check(isinstance(value, numbers.Real), f"sampling.{name} must be a number, got {value!r}")
    for name in INT_FIELDS + OPTIONAL_INT_FIELDS:
        value = getattr(p, name)
        check(isinstance(value, numbers.Integral) or (value is None and name in OPTIONAL_INT_FIELDS),
              f"sampling.{name} must be an integer, got {value!r}")
    check(isinstance(p.stop, (list, tuple)) and all(isinstance(s, str) for s in p.stop),
          f"sampling.stop must be a list of strings, got {p.stop!r}")
    check(isinstance(p.stop_token_ids, (list, tuple)) and all(isinstance(t, numbers.Integral)
                                                              for t in p.stop_token_ids),
          f"sampling.stop_token_ids must be a list of integers, got {p.stop_token_ids!r}")


def _check_floats(p: SamplingParams) -> None:
    for name, interval in FLOAT_RANGES.items():
        value = getattr(p, name)
        check(math.isfinite(as_float32(value)),
              f"sampling.{name} must be a finite number (a 32-bit float), got {value}")
        check(interval.holds(value), f"sampling.{name} must be {interval}{interval.why}, got {value}")


def _check_beam_search(p: SamplingParams) -> None:
    """Beam search scores with the raw log-softmax: the sampling knobs would be silently ignored."""
    off = "does not apply to beam search (beam_width > 0)"
    check(p.n <= p.beam_width,
          f"sampling.n ({p.n}) must be <= beam_width ({p.beam_width}): beam search returns the n best of its beams")
    for name, default in (("top_p", 1), ("top_k", 0), ("min_p", 0), ("presence_penalty", 0),
                          ("frequency_penalty", 0), ("repetition_penalty", 1)):
        value = getattr(p, name)
        check(value == default, f"sampling.{name} {off}; leave it at {default}, got {value}")
    check(p.seed is None, f"sampling.seed {off}: beam search is deterministic; leave it unset")


def _check_constraint(p: SamplingParams) -> None:
    """At most one structured-output constraint, of the right type, that llguidance compiles (no tokenizer
    needed: the scheduler compiles it again with the model's, and answers the rare error that only shows
    then the same way)."""
    kinds = p.constraint_kinds()
    if not kinds:
        return
    check(len(kinds) == 1, f"set at most one of sampling.json_schema, json_object, regex, grammar, choice; "
                           f"got {', '.join(kinds)}")
    kind = kinds[0]
    value = getattr(p, kind)
    if kind == "choice":
        check(isinstance(value, (list, tuple)) and all(isinstance(c, str) for c in value),
              f"sampling.choice must be a list of strings, got {value!r}")
        check(len(value) > 0 and all(value), "sampling.choice needs at least one string, and no empty one")
    elif kind == "json_schema":
        check(isinstance(value, (str, dict)), f"sampling.json_schema must be JSON text or a dict, got {type(value)}")
    elif kind != "json_object":
        check(isinstance(value, str), f"sampling.{kind} must be a string, got {value!r}")
    check(p.beam_width == 0, f"sampling.{kind} (structured output) does not apply to beam search (beam_width > 0)")
    try:
        constraint = p.constraint()
    except (TypeError, ValueError) as exc:  # a dict schema that is not JSON-serializable
        raise InvalidArgument(f"sampling.{kind}: {exc}") from exc
    size = constraint.ByteSize()
    check(size <= MAX_CONSTRAINT_BYTES, f"sampling.{kind} is {size} bytes; the limit is {MAX_CONSTRAINT_BYTES}")
    try:
        error = grammar_error(constraint)
    except GrammarBusy as exc:
        raise Overloaded(f"sampling.{kind} cannot be checked now: {exc}; try again later") from exc
    check(not error, f"sampling.{kind}: {error}")


# ---------------------------------------------------------------- the shared checks


def check_token_ids(ids, vocab_size: int, field: str) -> None:
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return  # the common case in two C loops: a Python loop over a long prompt costs the engine its start
    for i, t in enumerate(ids):
        check(0 <= t < vocab_size, f"{field}[{i}] = {t} is outside the vocabulary [0, {vocab_size})")


def check_sampling(p: SamplingParams, limits: RequestLimits | None = None) -> None:
    """Every check of SamplingParams that needs no engine facts (the CLI runs it before starting the engine)."""
    limits = limits or RequestLimits()
    _check_types(p)
    _check_floats(p)
    check(0 <= p.top_k < INT32_END, f"sampling.top_k must be in [0, 2^31) (0 disables it), got {p.top_k}")
    check(p.min_tokens >= 0, f"sampling.min_tokens must be >= 0, got {p.min_tokens}")
    if p.max_tokens is not None:  # None is resolved against the prompt by validate_request
        check(p.max_tokens >= 1, f"sampling.max_tokens must be >= 1, got {p.max_tokens}")
        check(p.min_tokens <= p.max_tokens,
              f"sampling.min_tokens ({p.min_tokens}) must be <= max_tokens ({p.max_tokens})")
    check(1 <= p.n <= limits.max_n, f"sampling.n must be in [1, {limits.max_n}], got {p.n}")
    check(0 <= p.logprobs <= limits.max_logprobs,
          f"sampling.logprobs must be in [0, {limits.max_logprobs}], got {p.logprobs}")
    check(p.seed is None or 0 <= p.seed < 2**63, f"sampling.seed must be in [0, 2^63), got {p.seed}")
    check(len(p.stop) <= limits.max_stop_strings,
          f"sampling.stop has {len(p.stop)} strings; the limit is {limits.max_stop_strings}")
    for i, s in enumerate(p.stop):
        check(0 < len(s) <= limits.max_stop_string_length,
              f"sampling.stop[{i}] has {len(s)} characters; it must have 1 to {limits.max_stop_string_length}")
    check(0 <= p.beam_width <= limits.max_beam_width,
          f"sampling.beam_width must be in [0, {limits.max_beam_width}] (0 samples), got {p.beam_width}")
    if p.beam_width > 0:
        _check_beam_search(p)
    _check_constraint(p)


def validate_request(prompt_token_ids: list[int], params: SamplingParams, ready: engine_pb2.EngineReady,
                     limits: RequestLimits) -> ValidRequest:
    """A tokenized prompt and its params against the engine; the params come back with max_tokens set
    (unset means the default limit, cut to fit max_model_len and the KV cache)."""
    ids, vocab_size, max_model_len = list(prompt_token_ids), ready.model.vocab_size, ready.max_model_len
    check(len(ids) > 0, "the prompt has no tokens")
    check_token_ids(ids, vocab_size, "prompt_token_ids.ids")
    check(len(ids) < max_model_len,
          f"the prompt has {len(ids)} tokens; it must be shorter than max_model_len = {max_model_len}")
    num_blocks, block_size = ready.model.num_blocks, ready.model.block_size
    check(len(ids) < num_blocks * block_size,
          f"the prompt has {len(ids)} tokens; it must be shorter than the KV cache, num_blocks x block_size = "
          f"{num_blocks} x {block_size} = {num_blocks * block_size} tokens")
    # a sequence can never hold more tokens than the whole KV cache, whatever max_model_len says
    kv_tokens = num_blocks * block_size
    limit, what = ((max_model_len, f"max_model_len = {max_model_len}") if max_model_len <= kv_tokens else
                   (kv_tokens, f"the KV cache's {kv_tokens} tokens (num_blocks x block_size)"))
    room = limit - len(ids)
    if params.max_tokens is None:
        params = dataclasses.replace(params, max_tokens=min(limits.default_max_tokens, room))
    check_sampling(params, limits)
    if params.top_k >= vocab_size:  # keeps every token: no filter (the scheduler takes top_k <= vocab only)
        params = dataclasses.replace(params, top_k=0)
    check(params.max_tokens <= room,
          f"sampling.max_tokens = {params.max_tokens} does not fit: prompt tokens + max_tokens must be "
          f"<= {what}, which leaves room for {room}")
    check_token_ids(params.stop_token_ids, vocab_size, "sampling.stop_token_ids")
    return ValidRequest(ids, params)


# ---------------------------------------------------------------- the public request (gRPC)


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


def prompt_token_ids(request: generation_pb2.GenerateRequest, tokenizer: Tokenizer | None) -> list[int]:
    """The request's one input as token ids; validate_request checks them."""
    kind = request.WhichOneof("input")
    check(kind is not None, "one input is required: prompt, prompt_token_ids or messages")
    if kind == "prompt":
        check(len(request.prompt) > 0, "prompt is empty")
        return _need_tokenizer(tokenizer, "prompt").encode(request.prompt)
    if kind == "prompt_token_ids":
        check(len(request.prompt_token_ids.ids) > 0, "prompt_token_ids.ids is empty")
        return list(request.prompt_token_ids.ids)
    return chat_token_ids(request.messages, tokenizer, "messages")


def validate_generate(request: generation_pb2.GenerateRequest, tokenizer: Tokenizer | None,
                      ready: engine_pb2.EngineReady, limits: RequestLimits) -> ValidRequest:
    check(len(request.request_id) <= MAX_REQUEST_ID_LENGTH,
          f"request_id has {len(request.request_id)} characters; the limit is {MAX_REQUEST_ID_LENGTH}")
    return validate_request(prompt_token_ids(request, tokenizer), from_api(request.sampling), ready, limits)
