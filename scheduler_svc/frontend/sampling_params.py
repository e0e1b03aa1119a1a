"""User-facing sampling parameters and their wire forms.

SamplingParams mirrors nanoserve.v1.SamplingParams field for field. It holds no checks: validation.py
is the one place that checks it, for the gRPC service and the offline LLM alike.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from protos import engine_pb2, generation_pb2


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None  # None: the default limit, cut to fit max_model_len (validation.py sets it)
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1
    logprobs: int = 0  # top-N candidates per generated token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    beam_width: int = 0  # 0 samples; k >= 1 runs beam search and returns the n best of k beams
    length_penalty: float = 1.0  # beam search: score = sum(logprob) / generated_len ** length_penalty
    # structured output, at most one of these (the oneof `constraint` of the API):
    json_schema: str | dict | None = None  # a JSON Schema, as JSON text or a dict
    json_object: bool = False  # True: any JSON object
    regex: str | None = None  # the whole completion matches it
    grammar: str | None = None  # llguidance's Lark-like grammar
    choice: list[str] | None = None  # exactly one of these strings
    disable_speculation: bool = False  # never verify proposed tokens for it (speculative decoding)

    def constraint_kinds(self) -> list[str]:
        """The structured-output fields that are set (valid params have at most one)."""
        kinds = [k for k in ("json_schema", "regex", "grammar", "choice") if getattr(self, k) is not None]
        return kinds + ["json_object"] * bool(self.json_object)

    def constraint(self) -> engine_pb2.Constraint | None:
        """Wire form of the structured-output constraint; None when there is none."""
        kinds = self.constraint_kinds()
        if not kinds:
            return None
        kind = kinds[0]
        if kind == "choice":
            return engine_pb2.Constraint(choice=engine_pb2.ChoiceList(choices=self.choice))
        if kind == "json_schema" and isinstance(self.json_schema, dict):
            return engine_pb2.Constraint(json_schema=json.dumps(self.json_schema))
        return engine_pb2.Constraint(**{kind: getattr(self, kind)})

    def sampling_options(self, seed_offset: int = 0) -> engine_pb2.SamplingOptions:
        """Wire form for the executor; seed_offset separates the n parallel samples of one request."""
        opts = engine_pb2.SamplingOptions(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            logprobs=self.logprobs, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
        )
        if self.seed is not None:
            opts.seed = (self.seed + seed_offset) % 2**64
        return opts

    def stopping_options(self) -> engine_pb2.StoppingOptions:
        if self.max_tokens is None:  # 0 on the wire would end the request before its first token
            raise ValueError("max_tokens is unset: send params that validation.validate_request returned")
        return engine_pb2.StoppingOptions(
            max_tokens=self.max_tokens, min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
        )

    def beam_search_options(self) -> engine_pb2.BeamSearchOptions | None:
        """Wire form of a beam search whose n best hypotheses go to n engine requests; None when sampling."""
        if self.beam_width <= 0:
            return None
        return engine_pb2.BeamSearchOptions(beam_width=self.beam_width, length_penalty=self.length_penalty,
                                            num_requests=self.n)

    def add_requests(self, request_ids: list[str], prompt_token_ids: list[int],
                     priority: int = 0, client_request_id: str = "") -> list[engine_pb2.AddRequest]:
        """The engine requests of the n completions, one per id, to be sent in this order.

        They share a group id (the first id): parallel samples so that the later ones reuse the
        first one's cached prompt, a beam search so that the scheduler runs one search for all of
        them and hands the i-th best hypothesis to the i-th request.
        """
        beam, constraint = self.beam_search_options(), self.constraint()
        group_id = request_ids[0] if beam is not None or len(request_ids) > 1 else ""
        return [engine_pb2.AddRequest(
            request_id=rid, prompt_token_ids=prompt_token_ids, sampling=self.sampling_options(seed_offset=i),
            stopping=self.stopping_options(), priority=priority, group_id=group_id,
            beam_search=beam, constraint=constraint, client_request_id=client_request_id,
            disable_speculation=self.disable_speculation)
            for i, rid in enumerate(request_ids)]


def from_api(sp: generation_pb2.SamplingParams) -> SamplingParams:
    """The public message as SamplingParams, unset optional fields at their documented defaults.
    Nothing is checked here."""
    def optional(name: str, default):
        return getattr(sp, name) if sp.HasField(name) else default

    kind = sp.WhichOneof("constraint")
    constraint = {} if kind is None else {kind: list(sp.choice.choices) if kind == "choice" else getattr(sp, kind)}

    return SamplingParams(
        temperature=optional("temperature", 1.0), top_p=optional("top_p", 1.0), top_k=sp.top_k, min_p=sp.min_p,
        seed=optional("seed", None), max_tokens=optional("max_tokens", None), min_tokens=sp.min_tokens,
        stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
        include_stop_str_in_output=sp.include_stop_str_in_output, n=optional("n", 1), logprobs=sp.logprobs,
        presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
        repetition_penalty=optional("repetition_penalty", 1.0), beam_width=sp.beam_width,
        length_penalty=optional("length_penalty", 1.0), disable_speculation=sp.disable_speculation, **constraint,
    )
