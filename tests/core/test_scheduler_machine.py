"""The scheduler under random traffic, as a hypothesis state machine.

Plain requests, parallel samples (one group, one prompt) and beam-search members arrive; up to `depth`
steps are planned ahead of their results, which are applied oldest first; any request may be aborted at
any moment, also while its steps are in flight; a tiny KV pool forces preemption by swap (when there is a
host pool with room) and by recompute. Every plan goes through build_step_plan to the executor's own
sequence mirrors and to a fake executor whose KV slots hold the token prefix whose K/V they store, so a
block shared, copied, swapped or reused wrongly, or a delta the executors cannot follow (invariant 4),
fails where it happens. The fake model is a function of a sequence's own history, so each request must
get exactly the tokens it gets when served alone (invariant 5).
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import replace

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from protos import engine_pb2
from scheduler_svc.common.config import PREEMPTION_MODES, PREEMPTION_POLICIES
from scheduler_svc.core.preemption_cost import PreemptionCosts
from scheduler_svc.core.prefix_cache import hash_block
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_config import SchedulerConfig
from scheduler_svc.core.scheduler_output import SchedulerOutput
from scheduler_svc.core.sequence import Sequence, SequenceStatus
from scheduler_svc.core.step_plan import build_step_plan
from support.fake_executor import MirroringExecutor, check_block_references
from test_beam_search import VOCAB, fake_logprobs, member

STOP, LENGTH, ABORT = engine_pb2.FINISH_REASON_STOP, engine_pb2.FINISH_REASON_LENGTH, engine_pb2.FINISH_REASON_ABORT
RUNNING, WAITING, SWAPPED = SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.SWAPPED
EOS = 0
BLOCK = 2
PREFIXES = [(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6), (3, 3)]  # shared prefixes, so the prefix cache hits
CONFIG = SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=6, max_model_len=14, block_size=BLOCK,
                         num_blocks=12, eos_token_ids=(EOS,))
MAX_SEQ_LEN = min(CONFIG.max_model_len, CONFIG.num_blocks * BLOCK)
BEAM_SALT = 0  # the beams' fake model; plain requests use it too, parallel samples each have their own


# ---------------------------------------------------------------- the fake model and what a request gets alone

def ranked(history, salt: int) -> tuple[list[int], list[float]]:
    """The next-token candidates after a token history, best first, with their logprobs."""
    lps = fake_logprobs(tuple(history), salt)
    order = sorted(range(VOCAB), key=lambda v: -lps[v])
    return order, [lps[v] for v in order]


def sample_step(out: SchedulerOutput, history_of, salt_of, void: set[int] = frozenset(),
                drawn: dict[int, list[int]] | None = None) -> tuple[dict[int, int], dict, dict[int, list[int]]]:
    """What the executor's sampler returns for a step: the greedy token of every sequence that samples, each
    beam's top candidates (as many as its sampling asks for), and for each sequence whose proposals the step
    verifies (drawn: a draft model's, by seq id), the leading ones that are the greedy tokens (its sampled token
    then follows them)."""
    sampled, candidates, accepted = {}, {}, {}
    for s in out.scheduled:
        if s.samples and s.seq.seq_id not in void:
            seq = s.seq
            history = list(history_of(seq)[: s.start + s.num_new_tokens - len(s.proposal)])
            ids, lps = ranked(history, salt_of(seq))
            guessed = s.guess < 0 or history[s.start] == s.guess  # a failed guess drops the proposals after it
            for proposed in ((drawn or {}).get(seq.seq_id, s.proposal) if guessed else ()):
                if proposed != ids[0]:
                    break
                accepted.setdefault(seq.seq_id, []).append(proposed)
                history.append(proposed)
                ids, lps = ranked(history, salt_of(seq))
            sampled[seq.seq_id] = ids[0]
            if seq.beam is not None:
                k = seq.sampling.logprobs
                candidates[seq.seq_id] = (ids[:k], lps[:k])
    return sampled, candidates, accepted


def greedy_alone(seq: Sequence, salt: int) -> tuple[list[int], int]:
    """The output and finish reason of a request served alone: greedy until a stop token counts (EOS unless
    ignore_eos, or a stop token id, after min_tokens) or the length limit."""
    stopping, n = seq.stopping, seq.num_prompt_tokens
    stops = set(stopping.stop_token_ids) | (set() if stopping.ignore_eos else {EOS})
    limit = min(MAX_SEQ_LEN, n + stopping.max_tokens) if stopping.max_tokens else MAX_SEQ_LEN
    tokens = list(seq.token_ids[:n])
    while True:
        tokens.append(ranked(tokens, salt)[0][0])
        if tokens[-1] in stops and len(tokens) - n >= stopping.min_tokens:
            return tokens[n:], STOP
        if len(tokens) >= limit:
            return tokens[n:], LENGTH


def beam_search_alone(config: SchedulerConfig, search: dict) -> list[tuple[list[int], int]]:
    """What member i of a search (member()'s keyword arguments) gets when the search runs alone, as (output,
    finish reason), for every i < width: the i-th best hypothesis."""
    sched = Scheduler(replace(config, num_host_blocks=0))
    members = [member(i + 1, "g", **(search | dict(n=search["width"]))) for i in range(search["width"])]
    for m in members:
        sched.add(m)
    for _ in range(200):
        if not sched.has_unfinished():
            return [(m.output_token_ids, m.finish_reason) for m in members]
        out = sched.schedule()
        sampled, candidates, _ = sample_step(out, lambda seq: seq.token_ids, lambda seq: BEAM_SALT)
        sched.postprocess(out, sampled, candidates)
    raise AssertionError("a beam search alone did not finish")


def chained_hash(tokens) -> int | None:
    h = None
    for i in range(0, len(tokens), BLOCK):
        h = hash_block(h, tuple(tokens[i: i + BLOCK]))
    return h


tokens = st.integers(0, VOCAB - 1)
prompts = st.builds(lambda prefix, suffix: [*prefix, *suffix], st.sampled_from(PREFIXES),
                    st.lists(tokens, min_size=1, max_size=8))
whole_block_prompts = st.builds(lambda prefix, pairs: [*prefix, *(t for pair in pairs for t in pair)],
                                st.sampled_from(PREFIXES), st.lists(st.tuples(tokens, tokens), min_size=1, max_size=4))


# ---------------------------------------------------------------- the machine

# The machine found five scheduler bugs, each now reproduced by a test in test_scheduler.py (after
# "found by test_scheduler_machine.py"): a fork writing into a hashed block, beam searches wedging the
# queue or deadlocking on blocks (twice: the second time beams idle in their round held the blocks their
# swapped siblings needed, while a newer sequence gave way instead of them), and preempted ids of an
# empty step getting lost.

class SchedulerMachine(RuleBasedStateMachine):
    depth = 1  # steps planned ahead of their results
    num_host_blocks = 0  # the executors' swap space; 0 preempts by recompute only
    enable_prefix_caching = True
    speculative_tokens = 0  # > 0: speculative decoding, with proposals of up to this many tokens
    chain = True  # with speculation and depth > 1: verifications planned before the verdicts before them
    draft = False  # speculation by a draft model in the executors (fake_executor's run_draft) rather than n-gram

    def __init__(self):
        super().__init__()
        self.start(replace(CONFIG, num_host_blocks=self.num_host_blocks,
                           enable_prefix_caching=self.enable_prefix_caching))

    def start(self, config: SchedulerConfig) -> None:
        if self.speculative_tokens:  # paused above 3 running sequences, so steps with and without it mix
            config = replace(config, speculative_method="draft" if self.draft else "ngram",
                             num_speculative_tokens=self.speculative_tokens, speculative_max_batch_size=3,
                             chain_verifications=self.chain and self.depth > 1 and not self.draft)
        self.config = config
        self.sched = Scheduler(self.config)
        if self.speculative_tokens and not self.draft:
            self.sched.speculator.propose = self.propose
        self.executor = MirroringExecutor(self.config.num_blocks, BLOCK, self.num_host_blocks, token_at=self.kv_at,
                                          proposed_at=self.kv_of_proposal, draft=self.draft_proposal)
        # (step, sampled, candidates, accepted proposals)
        self.in_flight: deque[tuple[SchedulerOutput, dict, dict, dict]] = deque()
        self.step_id = 0
        self.requests: list[Sequence] = []  # every request accepted, beam members included
        self.history: dict[int, list[int]] = {}  # seq_id -> prompt and every token the executor sampled for it
        self.salt: dict[int, int] = {}
        self.expected: dict[int, tuple[list[int], int]] = {}  # seq_id -> greedy_alone
        self.searches: dict[str, dict] = {}  # beam group_id -> member()'s keyword arguments
        self.pending_group = ""  # a beam search still waiting for members
        self.terminal_events: dict[str, int] = {}
        self.ids = itertools.count(1)
        self.void: dict[int, set[int]] = {}  # id(step) -> its void steps' seq ids

    # the executor side: what each KV slot must hold, and which tokens a sequence has

    def tokens_of(self, seq: Sequence) -> list[int]:
        """A beam's tokens are fixed when its search forks it; a request's grow with every sample."""
        return seq.token_ids if seq.beam is not None else self.history[seq.seq_id]

    def kv_at(self, seq: Sequence, pos: int) -> tuple[int, ...]:
        return tuple(self.tokens_of(seq)[: pos + 1])  # the K/V at a position depends on the whole prefix

    def kv_of_proposal(self, seq: Sequence, proposal, j: int) -> tuple[int, ...]:
        """A verifying step writes proposal j's K/V after every known token (it plans only then): the right
        contents where the proposal is accepted, another history where it is not."""
        return (*self.tokens_of(seq), *proposal[: j + 1])  # (the true tokens up to its input, at plan time)

    def void_steps(self, out: SchedulerOutput) -> set[int]:
        """The executors' settle(): chunks whose pending input is not at their start (an earlier verdict in flight
        was short) yield nothing; the scheduler marks the same ones void when that verdict reaches it."""
        void = set()
        for s in out.scheduled:
            first_proposed = s.start + s.num_new_tokens - len(s.proposal)
            if s.samples and s.seq.beam is None and first_proposed > s.seq.num_tokens:  # its input was pending
                if len(self.history[s.seq.seq_id]) != first_proposed:
                    void.add(s.seq.seq_id)
        return void

    def propose(self, seq: Sequence, tokens: list[int], k: int) -> list[int]:
        """Speculative decoding's proposals: the greedy continuation (what the fake model verifies), wrong from a
        place that varies with the sequence and its length, so every number of accepted proposals occurs, and
        sometimes nothing at all."""
        history, salt = list(tokens), self.salt_of(seq)
        wrong_at = (seq.seq_id + len(history)) % (k + 2)
        if wrong_at == k + 1:
            return []
        proposal = []
        for j in range(k):
            token = ranked(history, salt)[0][0]
            proposal.append((token + 1) % VOCAB if j == wrong_at else token)
            history.append(proposal[-1])
        return proposal

    def draft_proposal(self, seq: Sequence, k: int) -> list[int]:
        """A draft model's k proposals after every token of seq (it drafts only then): the greedy continuation,
        wrong from a place that varies with the sequence and its length, or nowhere."""
        history, salt = self.history[seq.seq_id], self.salt_of(seq)
        assert history == seq.token_ids, "a draft proposes after tokens still in flight"
        wrong_at = (seq.seq_id + len(history)) % (k + 1)  # k: all right
        proposal: list[int] = []
        for j in range(k):
            token = ranked(history + proposal, salt)[0][0]
            proposal.append((token + 1) % VOCAB if j == wrong_at else token)
        return proposal

    def salt_of(self, seq: Sequence) -> int:
        return BEAM_SALT if seq.beam is not None else self.salt[seq.seq_id]

    # ------------------------------------------------------------ arrivals

    def new_request(self, prompt, stopping, group_id="", priority=0) -> Sequence:
        seq_id = next(self.ids)
        return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", token_ids=list(prompt), num_prompt_tokens=len(prompt),
                        sampling=engine_pb2.SamplingOptions(), stopping=stopping, priority=priority, group_id=group_id,
                        speculate=True)  # (only where the scheduler speculates)

    def accept(self, seq: Sequence, salt: int = BEAM_SALT) -> bool:
        try:
            self.sched.add(seq)
        except ValueError as exc:
            assert seq.num_tokens >= self.config.max_model_len or "leaves no room" in str(exc), exc
            return False
        self.requests.append(seq)
        if seq.beam_options is None:
            self.history[seq.seq_id] = list(seq.token_ids)
            self.salt[seq.seq_id] = salt
            self.expected[seq.seq_id] = greedy_alone(seq, salt)
        return True

    @rule(prompt=prompts, max_tokens=st.integers(0, 6), min_tokens=st.integers(0, 2),
          stop=st.lists(st.integers(1, 5), max_size=2), ignore_eos=st.booleans(), priority=st.integers(0, 1))
    def add_request(self, prompt, max_tokens, min_tokens, stop, ignore_eos, priority):
        stopping = engine_pb2.StoppingOptions(max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=stop,
                                              ignore_eos=ignore_eos)
        self.accept(self.new_request(prompt, stopping, priority=priority))

    @rule(n=st.integers(2, 3), prompt=st.one_of(prompts, whole_block_prompts), max_tokens=st.integers(1, 6),
          ignore_eos=st.booleans())
    def add_parallel_samples(self, n, prompt, max_tokens, ignore_eos):
        group = f"s{next(self.ids)}"
        stopping = engine_pb2.StoppingOptions(max_tokens=max_tokens, ignore_eos=ignore_eos)
        for _ in range(n):
            seq = self.new_request(prompt, stopping, group_id=group)
            if not self.accept(seq, salt=1000 + seq.seq_id):  # each sample draws its own tokens
                return

    def gathering_search(self):
        search = self.sched.beams.searches.get((b"", self.pending_group))
        return search if search is not None and not search.started else None

    def join_search(self, group: str) -> bool:
        return self.accept(member(next(self.ids), group, **self.searches[group]))

    @rule(data=st.data())
    def add_beam_member(self, data):
        """A member of the search still gathering its members, or the first of a new one."""
        if self.gathering_search():
            self.join_search(self.pending_group)
            return
        width = data.draw(st.integers(1, 3), label="width")
        group = f"b{next(self.ids)}"
        self.searches[group] = dict(
            prompt=data.draw(prompts, label="prompt"), width=width, n=data.draw(st.integers(1, width), label="n"),
            max_tokens=data.draw(st.integers(1, 4), label="max_tokens"),
            min_tokens=data.draw(st.integers(0, 2), label="min_tokens"),
            length_penalty=data.draw(st.sampled_from([0.0, 1.0, 2.0]), label="length_penalty"))
        if self.join_search(group):
            self.pending_group = group

    # ------------------------------------------------------------ steps

    @precondition(lambda self: len(self.in_flight) < self.depth)
    @rule()
    def schedule(self):
        sched, cfg = self.sched, self.config
        waiting_before, swapped_before = set(sched.waiting), set(sched.swapped)
        samples_waiting = {s for s in sched.waiting if s.leader is not None}
        running_before = {s.seq_id: s for s in sched.running}
        idle_beams = {s for s in sched.running if s.beam is not None and s.num_uncomputed_tokens <= 0}
        c = sched.counters
        preemptions, swap_outs, for_priority = c.num_preemptions, c.num_swap_outs, c.num_priority_preemptions
        out = sched.schedule()
        for_priority = c.num_priority_preemptions - for_priority

        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled) <= cfg.max_num_batched_tokens
        assert len({s.seq.seq_id for s in out.scheduled}) == len(out.scheduled)
        forked = {s for s in samples_waiting if s.status is RUNNING}
        sent_in_full = {s.seq for s in out.scheduled if s.is_new}
        admitted, swapped_in = sent_in_full & waiting_before - forked, sent_in_full & swapped_before
        victims = {s for s in running_before.values() if s.status is not RUNNING and not s.is_finished}
        # admission waits while memory is short, except that an empty step may preempt beams idle in their round,
        # and that under the priority policy a waiting request takes the room of running ones of lower priority
        gave_way, joined = victims - idle_beams, admitted | swapped_in
        assert not (gave_way and joined) or (len(gave_way) == for_priority and all(
            v.priority > min(j.priority for j in joined) for v in gave_way)), "admitted while preempting"
        event_if(victims and victims <= idle_beams, "an idle beam gave way")
        event_if(for_priority, "preempted for a waiting request of higher priority")
        assert bool(swapped_in) == bool(out.swap_in)
        for s in out.scheduled:
            seq, end = s.seq, s.start + s.num_new_tokens
            assert len(seq.block_table) * BLOCK >= end  # lookahead slots for the proposals included
            if s.proposal:  # verified after the sequence's every token, or after a guess of the one in flight
                assert seq.verifying and s.samples and s.num_new_tokens == len(s.proposal) + 1 and not s.is_new
                assert s.start == seq.num_tokens - 1 or (s.guess >= 0 and self.config.chain_verifications)
            # proposals count as computed (and placeholders) until a verdict says otherwise
            assert seq.status is RUNNING and s.num_new_tokens >= 1 and seq.num_computed_tokens == end
            total = seq.num_tokens + seq.num_placeholders
            if s.samples:  # its chunk reached the end: placeholder tokens now stand for the sample (and proposals)
                assert end == total - 1 and 0 < seq.num_placeholders <= self.depth * (self.speculative_tokens + 1)
            else:
                assert end < total

        num_preempted = sched.counters.num_preemptions - preemptions
        num_swapped = sched.counters.num_swap_outs - swap_outs
        event_if(num_swapped, "preempted by swap")
        event_if(num_preempted > num_swapped, "preempted by recompute")
        event_if(any(running_before[i].num_placeholders for i in out.preempted_seq_ids if i in running_before),
                 "preempted with a sample in flight")
        event_if(any(v.verifying for v in victims), "preempted while its proposals are verified")
        event_if(out.swap_in, "swapped back in")
        event_if(forked, "parallel sample forked its leader's prompt")
        event_if(out.block_copies, "copy-on-write")
        event_if(any(s.seq.beam is not None and s.seq.num_output_tokens for s in out.scheduled if s.is_new),
                 "forked beam ran")
        event_if(any(s.start for s in out.scheduled if s.seq in admitted), "admitted with a prefix hit")
        if not out.scheduled:  # nothing runs, so nothing is sent: what executors must hear waits for a step
            assert not (out.finished_seq_ids or out.preempted_seq_ids or out.swap_out or out.swap_in
                        or out.block_copies)
            event_if(self.sched.preempted_to_drop, "preempted in a step that schedules nothing")
            return
        self.step_id += 1  # the engine sends the plan (the last token only when nothing else is in flight)
        void = self.void_steps(out)
        self.void[id(out)] = void
        self.executor.run_plan(build_step_plan(self.step_id, out, send_last_token=self.depth == 1), out, void)
        self.in_flight.append((out, *sample_step(out, self.tokens_of, self.salt_of, void, self.executor.drawn)))
        accepted = self.in_flight[-1][3]
        event_if(void, "a step planned on proposals in flight is void")
        event_if(any(s.guess >= 0 for s in out.scheduled), "proposals after a guess of a token in flight")
        for seq_id, token in self.in_flight[-1][1].items():
            s = next(s for s in out.scheduled if s.seq.seq_id == seq_id)
            if s.seq.beam is None:
                history = self.history[seq_id]
                assert len(history) == s.start + s.num_new_tokens - len(s.proposal), \
                    "a sample extends its sequence by one token"
                history += accepted.get(seq_id, []) + [token]  # after the proposals it accepted
        event_if(len(self.in_flight) >= 2, f"{len(self.in_flight)} steps in flight")
        verified = [s for s in out.scheduled if s.proposal]
        event_if(verified, "proposals verified")
        event_if(any(len(accepted.get(s.seq.seq_id, ())) == len(s.proposal) for s in verified), "all accepted")
        event_if(any(0 < len(accepted.get(s.seq.seq_id, ())) < len(s.proposal) for s in verified), "some accepted")
        event_if(any(not accepted.get(s.seq.seq_id) for s in verified), "none accepted")
        event_if(verified and len(verified) < len(out.scheduled), "verified beside other chunks")

    @precondition(lambda self: self.in_flight)
    @rule()
    def postprocess(self):
        out, sampled, candidates, accepted = self.in_flight.popleft()
        void = self.void.pop(id(out))
        self.executor.reply(sampled, accepted, void)
        live = [s for s in out.scheduled if not s.seq.is_finished]  # aborted while in flight: skipped
        rounds_before = {g: list(search.beams) for g, search in self.sched.beams.searches.items()}
        trimmed = {s.seq.seq_id: len(s.seq.block_table) for s in live if s.proposal}
        updates = self.sched.postprocess(out, sampled, candidates, accepted=accepted)
        plain = [u for u in updates if u.seq.beam_options is None]
        assert [u.seq for u in plain] == [s.seq for s in live if s.seq.beam is None]
        for u, s in zip(plain, (s for s in live if s.seq.beam is None)):
            assert s.void == (s.seq.seq_id in void), "the scheduler and the executors find the same steps void"
            if s.void:
                assert u.new_token_id is None and not u.finish_reason
            elif s.proposal:  # the accepted proposals and the token after them, up to one that stops the request
                new = accepted.get(u.seq.seq_id, []) + [sampled[u.seq.seq_id]]
                assert [*u.accepted_token_ids, u.new_token_id] == new[: len(u.accepted_token_ids) + 1]
                assert u.seq.verifying == any(p.proposal and not p.void for p in u.seq.steps_in_flight)
                if u.seq.status is RUNNING and u.seq.epoch == s.epoch and not u.seq.steps_in_flight:
                    # the rejected tail's blocks went back (with steps in flight, only past what they write)
                    assert len(u.seq.block_table) == min(-(-u.seq.num_tokens // BLOCK), trimmed[u.seq.seq_id])
                    event_if(len(u.seq.block_table) < trimmed[u.seq.seq_id], "lookahead blocks given back")
            else:
                assert u.new_token_id == (sampled[u.seq.seq_id] if s.samples else None)
            if u.finish_reason:
                self.record_terminal(u.seq)
                assert (u.seq.output_token_ids, u.finish_reason) == self.expected[u.seq.seq_id], \
                    "a request's tokens are those it gets alone"
                event(f"request finished with {engine_pb2.FinishReason.Name(u.finish_reason)}")
        ended: dict[str, list[Sequence]] = {}  # searches that ended in this step; member i gets the i-th best
        for u in updates:
            if u.seq.beam_options is not None:
                ended.setdefault(u.seq.group_id, []).append(u.seq)
        for group, members in ended.items():
            alone = beam_search_alone(self.config, self.searches[group])
            assert [(m.output_token_ids, m.finish_reason) for m in members] == alone[: len(members)]
            for m in members:
                self.record_terminal(m)
            event("beam search finished")
        event_if(len(ended) > 1, "two beam searches ended in one step")
        searches = self.sched.beams.searches
        event_if(any(g in searches and searches[g].beams != beams for g, beams in rounds_before.items()),
                 "beam round forked the chosen continuations")

    @rule(data=st.data())
    def abort(self, data):
        if not self.requests:
            return
        seq = data.draw(st.sampled_from(self.requests))
        was_finished = seq.is_finished
        in_flight = {s.seq for step in self.in_flight for s in step[0].scheduled}
        search = self.sched.beams.searches.get(seq.group_id) if seq.beam_options is not None else None
        runs_in_flight = seq in in_flight or (search is not None and bool(in_flight & set(search.beams)))
        got = self.sched.abort(seq.request_id)
        assert (got is None) == was_finished
        if got is not None:
            assert got is seq and got.block_table == [] and got.finish_reason == ABORT
            self.record_terminal(got)
            if seq.beam_options is None:  # what it had so far is what it gets alone
                assert seq.output_token_ids == self.expected[seq.seq_id][0][: seq.num_output_tokens]
            event_if(runs_in_flight, "aborted with a step in flight")
            event_if(seq.beam_options is not None, "beam-search member aborted")

    @rule()
    def drain(self):
        """Everything eventually finishes: no request wedges the queue, and nothing is left behind."""
        while self.gathering_search():  # a search gathering members gets them all
            self.join_search(self.pending_group)
        sched = self.sched
        for _ in range(400):
            if not (sched.has_unfinished() or self.in_flight):
                break
            if len(self.in_flight) < self.depth and sched.has_unfinished():
                planned = len(self.in_flight)
                self.schedule()
                if len(self.in_flight) > planned:
                    continue
            assert self.in_flight, "work is left, nothing can be scheduled and nothing is in flight: wedged"
            self.postprocess()
        else:
            raise AssertionError("the scheduler did not drain")
        bm = sched.block_manager
        assert bm.num_free_blocks == bm.num_blocks and (bm.host_pool is None or
                                                        bm.host_pool.num_free_blocks == bm.host_pool.num_blocks)
        assert not (sched.requests or sched.stop_rules or sched.beams.searches or sched.samples.leaders)
        # (pending_swap_outs may still hold the copies of a sequence that finished while swapped, before a
        # step carried them: they go, harmless, into free host blocks with the next step that runs)
        assert sched.samples.num_waiting == 0
        assert all(self.terminal_events.get(r.request_id) == 1 for r in self.requests)

    def record_terminal(self, seq: Sequence) -> None:
        self.terminal_events[seq.request_id] = self.terminal_events.get(seq.request_id, 0) + 1
        assert self.terminal_events[seq.request_id] == 1, "exactly one terminal event per request (invariant 7)"

    # ------------------------------------------------------------ invariants

    @invariant()
    def reference_counts_equal_holders(self):
        check_block_references(self.sched)  # device and host pools; len(running) <= max_num_seqs

    @invariant()
    def free_and_used_partition_each_pool(self):
        bm = self.sched.block_manager
        for pool in (bm.pool, bm.host_pool) if bm.host_pool is not None else (bm.pool,):
            assert set(pool.free_queue) == {blk.block_id for blk in pool.blocks if blk.ref_count == 0}
            assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks

    @invariant()
    def every_index_entry_names_the_contents_it_hashes(self):
        pool = self.sched.block_manager.pool
        for h, b in pool.hash_to_block.items():
            blk = pool.blocks[b]
            assert blk.block_hash == h == hash_block(blk.parent_hash, blk.token_ids)
            prefix = self.executor.slots[b][BLOCK - 1]  # the K/V there was computed from this whole prefix
            assert prefix[-BLOCK:] == blk.token_ids and chained_hash(prefix) == h

    @invariant()
    def queues_hold_the_unfinished_requests_and_their_beams(self):
        sched = self.sched
        assert all(s.status is RUNNING for s in sched.running)
        for queue, status in ((sched.waiting, WAITING), (sched.swapped, SWAPPED)):
            assert all(s.status is status and not s.in_executor and not s.block_table for s in queue)
            keys = [(s.priority, s.arrival_order) for s in queue]
            assert keys == sorted(keys)
        for s in sched.swapped:  # its computed tokens' K/V waits in the host pool
            assert len(s.host_block_table) == -(-s.num_computed_tokens // BLOCK)
        unfinished = [r for r in self.requests if not r.is_finished]
        assert sched.requests == {r.request_key: r for r in unfinished}
        assert set(sched.stop_rules) == {r.seq_id for r in unfinished}
        beams = [b for search in sched.beams.searches.values() for b in search.beams]
        queued = sched.running + sched.waiting + sched.swapped
        assert len(set(queued)) == len(queued)
        assert set(queued) == {r for r in unfinished if r.beam_options is None} | set(beams)
        for r in self.requests:
            assert r.is_finished == (self.terminal_events.get(r.request_id, 0) == 1)
            if r.is_finished:
                assert r.block_table == [] and r.finish_reason in (STOP, LENGTH, ABORT)

    @invariant()
    def each_placeholder_is_a_token_the_executor_sampled(self):
        for seq in self.sched.running + self.sched.waiting + self.sched.swapped:
            if seq.beam is None:
                history = self.history[seq.seq_id]
                assert history[: seq.num_tokens] == seq.token_ids
                assert len(history) == seq.num_tokens + self.sampled_in_flight().get(seq.seq_id, 0)
                # each step in flight that is not void stands for its sample and its proposals
                steps = [s for s in seq.steps_in_flight if not s.void]
                if self.speculative_tokens and seq.speculate:
                    assert seq.num_placeholders == sum(1 + len(s.proposal) for s in steps)
            assert 0 <= seq.num_placeholders <= self.depth * (self.speculative_tokens + 1)

    def sampled_in_flight(self) -> dict[int, int]:
        """Per sequence, the tokens that steps in flight yield (known to the executors, not the scheduler)."""
        counts: dict[int, int] = {}
        for _, sampled, _, accepted in self.in_flight:
            for seq_id in sampled:
                counts[seq_id] = counts.get(seq_id, 0) + 1 + len(accepted.get(seq_id, ()))
        return counts

    @invariant()
    def only_accepted_tokens_are_hashed(self):
        """Invariant 6 under speculation: every hashed block holds tokens its sequence really has, and the K/V
        computed from exactly them (every_index_entry_names_the_contents_it_hashes checks the K/V)."""
        for seq in self.sched.running + self.sched.waiting + self.sched.swapped:
            assert seq.block_hashes == [chained_hash(seq.token_ids[: (i + 1) * BLOCK])
                                        for i in range(len(seq.block_hashes))]

    @invariant()
    def executors_mirror_the_running_sequences_until_told_to_drop_them(self):
        self.executor.check_mirrors(self.sched, self.tokens_of, self.sampled_in_flight())


def event_if(condition, name: str) -> None:
    if condition:
        event(name)


class EveryPreemptionMachine(SchedulerMachine):
    """The machine under a preemption mode and policy drawn for each run, with cost-model constants that make
    auto go either way: swapping a block out and in costs 3 s (two copies of its 1 byte at 1 byte/s, 0.5 s
    fixed each) and recomputing its 2 tokens 2 / rate, so auto swaps full blocks below a rate of 2/3 unless the
    prefix cache would give enough back (a rate of 0 is unknown: auto then swaps)."""

    @initialize(mode=st.sampled_from(PREEMPTION_MODES), policy=st.sampled_from(PREEMPTION_POLICIES),
                rate=st.sampled_from([0.0, 0.4, 0.6, 0.8, 2.0]))
    def choose_preemption(self, mode, policy, rate):
        costs = PreemptionCosts(block_bytes=1, host_link_bytes_per_s=1.0, copy_fixed_s=0.5, prefill_tokens_per_s=rate)
        self.start(replace(self.config, preemption_mode=mode, preemption_policy=policy, preemption_costs=costs))
        event(f"preemption {mode}, {policy}")


def machine_test(name: str, base: type = SchedulerMachine, **attrs):
    """A TestCase of the machine with these class attributes."""
    cls = type(name, (base,), attrs)
    case = cls.TestCase
    case.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    return case


TestOneStepInFlight = machine_test("OneStepInFlight")
TestOneStepInFlightWithSwapWithoutPrefixCaching = machine_test(
    "OneStepInFlightWithSwapWithoutPrefixCaching", num_host_blocks=6, enable_prefix_caching=False)
TestTwoStepsInFlightWithSwap = machine_test("TwoStepsInFlightWithSwap", depth=2, num_host_blocks=8)
TestThreeStepsInFlightByRecompute = machine_test("ThreeStepsInFlightByRecompute", depth=3)
TestThreeStepsInFlightWithSwapWithoutPrefixCaching = machine_test(
    "ThreeStepsInFlightWithSwapWithoutPrefixCaching", depth=3, num_host_blocks=6, enable_prefix_caching=False)
TestEveryPreemptionModeAndPolicyTwoStepsInFlight = machine_test(
    "EveryPreemptionModeAndPolicyTwoStepsInFlight", EveryPreemptionMachine, depth=2, num_host_blocks=8)
TestSpeculativeOneStepInFlightWithSwap = machine_test(
    "SpeculativeOneStepInFlightWithSwap", EveryPreemptionMachine, speculative_tokens=3, num_host_blocks=8)
TestSpeculativeTwoStepsInFlight = machine_test("SpeculativeTwoStepsInFlight", depth=2, speculative_tokens=2)
TestSpeculativeTwoStepsInFlightUnchained = machine_test("SpeculativeTwoStepsInFlightUnchained", depth=2,
                                                        speculative_tokens=2, chain=False)
TestSpeculativeThreeStepsInFlightWithSwap = machine_test(
    "SpeculativeThreeStepsInFlightWithSwap", EveryPreemptionMachine, depth=3, speculative_tokens=3, num_host_blocks=8)
TestSpeculativeDraftOneStepInFlightWithSwap = machine_test(
    "SpeculativeDraftOneStepInFlightWithSwap", EveryPreemptionMachine, speculative_tokens=3, num_host_blocks=8,
    draft=True)
TestSpeculativeDraftTwoStepsInFlight = machine_test("SpeculativeDraftTwoStepsInFlight", depth=2, speculative_tokens=2,
                                                    draft=True)
TestEveryPreemptionModeAndPolicyThreeStepsInFlightWithoutPrefixCaching = machine_test(
    "EveryPreemptionModeAndPolicyThreeStepsInFlightWithoutPrefixCaching", EveryPreemptionMachine, depth=3,
    num_host_blocks=6, enable_prefix_caching=False)
