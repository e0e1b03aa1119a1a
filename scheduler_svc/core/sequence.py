"""A sequence: one prompt and the tokens generated for it, as the scheduler tracks it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from protos import engine_pb2


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV saved in the host pool
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    seq_id: int  # unique for the scheduler's lifetime
    request_id: str  # the client's id
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    sampling: engine_pb2.SamplingOptions
    stopping: engine_pb2.StoppingOptions
    priority: int = 0  # lower first
    group_id: str = ""  # shared by the parallel samples of one request
    reply_to: bytes = b""  # the transport identity of the front end that sent the request
    client_request_id: str = ""  # the id its client knows, shared by the n completions of one request
    leader: "Sequence | None" = None  # the sibling whose cached prompt this one waits to reuse
    beam_options: engine_pb2.BeamSearchOptions | None = None  # a member of a beam search (AddRequest.beam_search)
    beam: "object | None" = None  # the BeamSearch this sequence is a beam of (beams are the scheduler's own)
    constraint: engine_pb2.Constraint | None = None  # structured output (AddRequest.constraint); None: free text
    cum_logprob: float = 0.0  # a beam's summed logprob over its generated tokens
    beam_logprobs: list = field(default_factory=list)  # a beam's (or finished member's) per-token logprobs
    arrival_order: int = 0  # ties broken by arrival
    status: SequenceStatus = SequenceStatus.WAITING

    num_computed_tokens: int = 0  # tokens whose K/V is in the pool or being computed by a step in flight
    num_placeholders: int = 0  # tokens sampled by steps in flight, not yet known here
    epoch: int = 0  # counts preemptions: a step planned in an earlier epoch wrote blocks it no longer has
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (or a fork) at first admission
    prompt_computed: bool = False  # a step that computed the whole prompt succeeded, in this epoch
    num_preempted_tokens: int = 0  # computed tokens a preemption by recompute dropped, until it is admitted again
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hash of each full, hashed block
    host_block_table: list[int] = field(default_factory=list)  # while swapped: host blocks of its computed tokens

    # speculative decoding (core/speculative/)
    speculate: bool = False  # proposed tokens may be verified for it (speculator.can_speculate)
    verifying: bool = False  # a step verifying its proposals is in flight (unless chained, nothing is planned until back)
    num_proposed_tokens: int = 0  # over its life, for its usage
    num_accepted_tokens: int = 0
    speculation_backoff: int = 0  # plain decodes before it proposes again (core/speculative/policy.py)
    # its proposals' verdicts, decayed (policy.py): the first predicted token's (a proposal's first, or the guess
    # of a chained step's input) right and wrong; the later proposals' accepted and verdicts that stopped among them
    speculation_first_hits: float = 0.0
    speculation_first_misses: float = 0.0
    speculation_hits: float = 0.0
    speculation_misses: float = 0.0
    speculation_failures: int = 0  # verdicts in a row that accepted nothing
    proposer_cache: object = None  # the proposer's own per-sequence state (ngram.py: its tokens as an array)
    blocks_kept: int = -1  # the executors' mirror is cut to this many blocks by the next plan; -1: nothing to cut
    # async verification: its sampling steps in flight, oldest first (void ones too, until they are answered)
    steps_in_flight: list = field(default_factory=list)
    start_unsent: bool = False  # a short verdict moved num_computed_tokens back: the next plan tells the executors

    # executor mirror bookkeeping (invariant 4: plans carry deltas)
    in_executor: bool = False  # executors hold a mirror of this sequence
    num_blocks_sent: int = 0  # block_table entries the executors already know
    last_token_unsent: bool = False  # the newest sampled token has not reached the executors
    finish_reason: int = engine_pb2.FINISH_REASON_UNSPECIFIED
    stop_token_id: int = -1
    admitted_once: bool = False

    @property
    def request_key(self) -> tuple[bytes, str]:
        """Request ids are the front end's own: two front ends may use the same one."""
        return self.reply_to, self.request_id

    @property
    def group_key(self) -> tuple[bytes, str]:
        return self.reply_to, self.group_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_placeholders - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
