"""Iteration-level continuous batching: schedule() picks this step's work, postprocess() applies its result.

Running sequences go first (decodes, unfinished prefill chunks), then waiting ones are admitted with chunked
prefill (admission.py). When blocks run out a running sequence is preempted (whom: preemption_policy.py),
swapped to the host pool or recomputed later (preemption_cost.py); swapped ones resume before waiting ones are
admitted. Request groups (parallel samples, beam search) act through GroupHost (groups/group_host.py). With
async scheduling, schedule() runs before the last step's result is back: a sample in flight is a placeholder
token until postprocess() fills it in.
"""
from __future__ import annotations

import bisect

from protos import engine_pb2
from scheduler_svc.core.admission import admit
from scheduler_svc.core.groups.beam_scheduler import BeamScheduler
from scheduler_svc.core.groups.parallel_samples import ParallelSamples
from scheduler_svc.core.kv_cache_manager import BlockManager
from scheduler_svc.core.preemption_policy import Preemption
from scheduler_svc.core.scheduler_config import SchedulerConfig
from scheduler_svc.core.scheduler_output import ScheduledSeq, SchedulerOutput, StepUpdate
from scheduler_svc.core.scheduler_stats import SchedulerCounters, count_step, stats_of
from scheduler_svc.core.sequence import Sequence, SequenceStatus
from scheduler_svc.core.speculative.speculator import Speculator
from scheduler_svc.core.stop_rules import UNFINISHED, StopRule, check_stop, stop_reason, stop_rule_for
from scheduler_svc.core.structured.compiler import GrammarCompiler, tokenizer_loader
from scheduler_svc.core.structured.mask_fill import default_fill_threads
from scheduler_svc.core.structured.structured_outputs import StructuredOutputs


ABORT = engine_pb2.FINISH_REASON_ABORT
RUNNING, WAITING, SWAPPED, FINISHED = (SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.SWAPPED,
                                       SequenceStatus.FINISHED)


def _speculator(config: SchedulerConfig) -> Speculator | None:
    """The proposer --speculative-method names: n-gram lookup here, or the executors' draft model."""
    if config.speculative_method == "ngram":
        return Speculator.ngram(config.num_speculative_tokens, config.ngram_min, config.ngram_max,
                                config.speculative_max_batch_size, config.chain_verifications)
    if config.speculative_method == "draft":
        return Speculator.draft(config.num_speculative_tokens, config.speculative_max_batch_size)
    return None


def _queue_order(seq: Sequence) -> tuple[int, int]:
    """Waiting and swapped sequences are served by priority, then arrival."""
    return seq.priority, seq.arrival_order


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                          config.num_host_blocks)
        # A sequence never holds more tokens than one of them fits in the whole pool.
        self.max_seq_len = min(config.max_model_len, config.num_blocks * config.block_size)
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival_order)
        self.running: list[Sequence] = []  # in admission order
        self.swapped: list[Sequence] = []  # sorted like waiting; resumed before waiting ones are admitted
        self.pending_swap_outs: list[tuple[int, int]] = []  # for the next plan that runs
        self.requests: dict[tuple[bytes, str], Sequence] = {}  # unfinished, by request key (front end, id)
        self.finished_to_drop: list[int] = []  # ids for the next SchedulerOutput.finished_seq_ids
        self.preempted_to_drop: list[int] = []  # preempted by a step that scheduled nothing, so sent no plan
        self.stop_rules: dict[int, StopRule] = {}  # by seq_id, unfinished requests only
        self.samples = ParallelSamples(self)
        self.beams = BeamScheduler(self)
        fill_threads = config.mask_fill_threads or default_fill_threads()
        self.structured = StructuredOutputs(GrammarCompiler(tokenizer_loader(
            config.tokenizer_dir, config.vocab_size, config.eos_token_ids), num_lexers=fill_threads),
            config.vocab_size, fill_threads)
        self.counters = SchedulerCounters()
        self.speculator = _speculator(config)
        if self.speculator is not None and self.speculator.drafts and config.chain_verifications:
            raise ValueError("a draft model proposes from a sequence's true tokens: its verifications are not chained")
        self.preemption = Preemption(self, config.preemption_mode, config.preemption_policy, config.preemption_costs,
                                     config.world_size)
        self._next_arrival = 0
        self._next_seq_id = 1

    def new_seq_id(self) -> int:
        """A fresh id for a request's sequence (beams draw from a range of their own)."""
        self._next_seq_id += 1
        return self._next_seq_id - 1

    # ------------------------------------------------------------------ requests

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Raises ValueError for one that could never run."""
        n, cfg = seq.num_prompt_tokens, self.config
        if n <= 0 or n != seq.num_tokens:
            raise ValueError(f"seq {seq.seq_id}: prompt must be non-empty and hold every token, got {n}")
        if n >= cfg.max_model_len:
            raise ValueError(
                f"prompt of {n} tokens leaves no room to generate within max_model_len={cfg.max_model_len}")
        if n >= cfg.num_blocks * cfg.block_size:
            raise ValueError(
                f"prompt of {n} tokens leaves no room to generate within the KV pool: num_blocks={cfg.num_blocks}"
                f" x block_size={cfg.block_size} = {cfg.num_blocks * cfg.block_size} tokens")
        if seq.request_key in self.requests:
            raise ValueError(f"request_id {seq.request_id!r} is already in flight")
        rule = stop_rule_for(seq, self.eos_token_ids, self.max_seq_len)
        search = self.beams.check(seq, rule) if seq.beam_options is not None else None
        if seq.constraint is not None:
            self.structured.add(seq)  # last check: from here on the request is taken
        seq.arrival_order = self._next_arrival
        self._next_arrival += 1
        seq.status = WAITING
        self.requests[seq.request_key] = seq
        self.stop_rules[seq.seq_id] = rule
        if search is not None:  # a member waits outside the queues; its search's beams run for it
            self.beams.join(search, seq)
            return
        if seq.group_id:
            self.samples.add(seq)
        self.push_waiting(seq)

    def abort(self, request_id: str, reply_to: bytes = b"") -> Sequence | None:
        """Finish a request of this front end now, its blocks back to the pool. None if it is unknown or
        already finished."""
        seq = self.requests.get((reply_to, request_id))
        if seq is None:
            return None
        if seq.beam_options is not None:
            self.beams.leave(seq)
        self.retire(seq, ABORT)
        self.counters.num_aborted += 1
        return seq

    def close(self) -> None:
        """Stop the scheduler's helper thread (structured output's grammar compiler)."""
        self.structured.compiler.close()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def requests_served_by(self, seq: Sequence) -> list[Sequence]:
        """The requests a sequence serves: itself, or for a beam its search's members."""
        return [seq] if seq.beam is None else list(seq.beam.members)

    def admit_compiled_grammars(self) -> list[tuple[Sequence, str]]:
        """Constrained requests whose grammar compiled may be admitted now; those whose grammar failed to
        compile are aborted and returned with the reason, for their front ends to be told."""
        failed = self.structured.poll()
        for seq, _ in failed:
            self.abort(seq.request_id, seq.reply_to)
        return failed

    def abort_incomplete_beam_searches(self, older_than: float) -> list[Sequence]:
        """Abort the members of beam searches gathering members since before older_than (monotonic)."""
        stale = self.beams.incomplete_members(older_than)
        for member in stale:
            self.abort(member.request_id, member.reply_to)
        return stale

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        """This step's work. Build the plan from it right away: an abort changes the sequences it names."""
        if self.samples.num_waiting:
            self.samples.fork_ready()
        scheduled: list[ScheduledSeq] = []
        preempted: list[int] = []
        block_copies: list[tuple[int, int]] = []
        budget = self.config.max_num_batched_tokens
        self.preemption.before_step(budget, preempted)  # priority preemption lets its request in, so it comes first
        num_preemptions = self.counters.num_preemptions
        budget = self._schedule_running(budget, scheduled, preempted, block_copies)
        num_running = len(scheduled)
        swap_in: list[tuple[int, int]] = []
        # Admit only while memory is not short (nothing was preempted this step).
        if self.counters.num_preemptions == num_preemptions:
            budget = admit(self, budget, scheduled, swap_in)
            # Beams that have reported hold their blocks until their round: when they are all that holds the
            # pool, one gives way (it recomputes later), or searches could wait on each other's blocks forever.
            if not scheduled and (self.waiting or self.swapped) and self.preemption.idle_beams_give_way(preempted):
                budget = admit(self, budget, scheduled, swap_in)
        for s in scheduled[num_running:]:  # running ones are mirrored already; admitted ones are sent in full now
            s.seq.in_executor = True
        # Drops and swap-outs ride on a step that runs. (Nothing scheduled means nothing ran.)
        finished, swap_out = [], []
        if scheduled:
            finished, self.finished_to_drop = self.finished_to_drop, []
            swap_out, self.pending_swap_outs = self.pending_swap_outs, []
            preempted, self.preempted_to_drop = self.preempted_to_drop + preempted, []
        else:
            self.preempted_to_drop += preempted  # no plan carries them this time
            preempted = []
        num_batched = self.config.max_num_batched_tokens - budget
        masks, late = self.structured.plan_masks(scheduled) if self.structured.matchers else (None, [])
        return SchedulerOutput(scheduled, preempted, finished, num_batched, block_copies, swap_out, swap_in,
                               num_prefill_tokens=count_step(self.counters, scheduled) if scheduled else 0,
                               token_bitmasks=masks, late_masked=late)

    def _schedule_running(self, budget: int, scheduled: list[ScheduledSeq], preempted: list[int],
                          block_copies: list[tuple[int, int]]) -> int:
        """Decodes and unfinished prefill chunks of running sequences, preempting when blocks run out.
        Returns the token budget left."""
        bm, bs = self.block_manager, self.config.block_size
        running, stop_rules = self.running, self.stop_rules
        speculating = self.speculator is not None and self.speculator.active(len(running))
        tracks = self.speculator is not None  # speculating sequences keep their steps in flight (steps_in_flight)
        chain = self.config.chain_verifications
        # a step of decodes and verifications runs as one row per token: at most max_num_seqs keeps it in the decode
        # CUDA graphs (DESIGN.md section 14)
        rows_left = self.config.max_num_seqs - len(running)
        # how many tokens each decoding sequence proposes (core/speculative/policy.py); absent: a plain decode
        planned = self.speculator.policy.plan(
            [s for s in running if s.speculate and s.in_executor and (not s.verifying or chain and self._chains(s))
             and len(s.token_ids) + s.num_placeholders - s.num_computed_tokens == 1], len(running)) \
            if speculating else {}
        i = 0
        while i < len(running) and budget > 0:  # the hot loop: a few hundred decodes per step
            seq = running[i]
            start, placeholders = seq.num_computed_tokens, seq.num_placeholders
            total = len(seq.token_ids) + placeholders
            num_new = min(total - start, budget)
            if num_new <= 0 or (seq.verifying and not (chain and self._chains(seq))) or (
                    placeholders and (seq.beam is not None or total >= stop_rules[seq.seq_id].max_num_tokens)):
                # nothing to compute, proposals being verified (how many tokens it gains is not known yet, and it
                # cannot be chained), a beam waiting for its round, or samples in flight reach its limit (a
                # constrained sequence runs on its placeholder: its mask follows the plan, see plan_masks)
                i += 1
                continue
            end = start + num_new
            is_new = not seq.in_executor
            proposal, guess = (), -1
            if speculating and seq.speculate and num_new == 1 and not is_new:
                # how many it proposes (0: a plain decode, planned ahead of its samples under async scheduling)
                k = min(planned.get(seq.seq_id, 0), budget - 1, rows_left)
                if k <= 0:
                    pass
                elif not placeholders:
                    proposal = self._proposal(seq, seq.token_ids, end, k)
                elif chain and self._chains(seq):  # proposals after a guess of the token in flight
                    assumed = self._assumed_tokens(seq)
                    if assumed is None:
                        # a plain decode in flight behind another guessed nothing (three or more steps in flight):
                        # planned ahead again it would never propose; it waits a step instead, then guesses
                        i += 1
                        continue
                    guessed = self._proposal(seq, assumed, end, k, guess=True)
                    if guessed:
                        guess, proposal = guessed[0], guessed[1:]
                else:  # a proposal needs every token: wait for the one in flight rather than plan ahead of it
                    i += 1
                    continue
                rows_left -= len(proposal)
            if proposal:  # lookahead slots for the proposals; _proposal checked the room: they never preempt
                bm.allocate(seq, end + len(proposal))
                seq.verifying = True
            elif is_new:  # forked since the last step: it may write a shared block
                if not self.preemption.make_room(seq, lambda: bm.can_append(seq, end), preempted):
                    break  # it preempted itself: nothing after it can run either
                block_copies += bm.copy_on_write(seq)
                bm.allocate(seq, end)
                seq.in_executor = True
            elif end > len(seq.block_table) * bs:  # most decodes fit in the table they have
                if not self.preemption.make_room(seq, lambda: bm.can_allocate(seq, end), preempted):
                    break
                bm.allocate(seq, end)
            if i >= len(running) or running[i] is not seq:  # idle beams ahead of it gave way
                i = running.index(seq)
            samples = end == total  # committed at schedule time; a sample leaves a placeholder token
            # proposals count as computed, and as placeholders, as if all will be accepted: a short verdict corrects
            # both (_apply_verified)
            seq.num_computed_tokens = end + len(proposal)
            if samples:
                seq.num_placeholders = placeholders + 1 + len(proposal)
            item = ScheduledSeq(seq, num_new + len(proposal), is_new, start, samples, seq.epoch, proposal, guess,
                                drafted=bool(proposal) and self.speculator.drafts)
            scheduled.append(item)
            if tracks and samples and seq.speculate:
                seq.steps_in_flight.append(item)
            budget -= num_new + len(proposal)
            i += 1
        return budget

    def _proposal(self, seq: Sequence, tokens: list[int], end: int, room: int, guess: bool = False) -> list[int]:
        """Tokens to verify after seq's last one (computed up to end): at most room (what the policy asks, within
        the step's budget), within the sequence's length limit (the step then adds at most len + 1 tokens) and the
        free blocks. tokens: the sequence's tokens, or those assumed while steps are in flight. guess: the first
        token returned guesses the pending input, the rest follow it (empty unless at least one follows)."""
        k = min(room, self.stop_rules[seq.seq_id].max_num_tokens - end - 1)
        if k <= 0:
            return []
        proposal = self.speculator.propose(seq, tokens, k + guess)[:k + guess]
        if len(proposal) <= guess or not self.block_manager.can_allocate(seq, end + len(proposal) - guess):
            return []
        return proposal

    @staticmethod
    def _chains(seq: Sequence) -> bool:
        """Whether its next step may be planned before its verdicts are back: a seeded row's draws must not
        depend on what was in flight when its steps were planned."""
        return seq.speculate and not seq.sampling.HasField("seed")

    @staticmethod
    def _assumed_tokens(seq: Sequence) -> list[int] | None:
        """Its tokens as the steps in flight assume them: each step's proposals, then the guess the step after it
        made of its last token; the newest step's last token is the one to guess now. None when a step in flight
        made no guess (its input is unknown)."""
        steps = [s for s in seq.steps_in_flight if not s.void]
        tokens = list(seq.token_ids)
        for n, s in enumerate(steps):
            tokens += s.proposal
            if n + 1 < len(steps):
                if steps[n + 1].guess < 0:
                    return None
                tokens.append(steps[n + 1].guess)
        return tokens

    def slots_reserved(self) -> int:
        """Started beam searches hold room for all their beams, so forking never passes max_num_seqs."""
        return self.beams.slots_reserved() if self.beams.searches else 0

    def has_room(self, seq: Sequence, reserved: int) -> bool:
        """Whether seq may join the running queue: a beam of a running search has its slot reserved already;
        the first beam of a search to run needs room for the whole width."""
        need = 1 if seq.beam is None else self.beams.room_needed(seq)
        return len(self.running) + reserved + need <= self.config.max_num_seqs

    # ------------------------------------------------------------------ postprocess

    def postprocess(self, out: SchedulerOutput, sampled: dict[int, int],
                    candidates: dict[int, tuple[list[int], list[float]]] | None = None,
                    checked: bool = False, accepted: dict[int, list[int]] | None = None) -> list[StepUpdate]:
        """Apply a successful step: hash newly full blocks, append samples, check stops. A failed step is
        applied with nothing sampled, after its requests were aborted.

        candidates: each sampled sequence's top continuations (token ids, logprobs; best first), which beams
        choose among; plain sequences ignore them. checked: the caller ran check_result() on this very reply
        already (the engine does, before accept_ahead), so it is not walked twice. accepted: for each sequence
        whose proposals the step verified, the leading ones accepted (absent: none), which precede its sample.
        """
        if not checked:
            self.check_result(out, sampled, candidates, accepted)
        live = [s for s in out.scheduled if s.seq.status is not FINISHED]  # skip ones aborted while in flight
        updates: list[StepUpdate] = []
        c = self.counters
        any_finished = False
        rounds = []  # beam searches whose every beam has reported
        for s in live:
            seq = s.seq
            if seq.beam is not None:
                self.beams.report(s, candidates, rounds)
                continue
            token, reason, error = None, UNFINISHED, ""
            if seq.steps_in_flight and s.samples:
                if seq.steps_in_flight[0] is not s:
                    raise RuntimeError(f"seq {seq.seq_id}: its steps were answered out of order")
                seq.steps_in_flight.pop(0)
                if s.void:  # planned on proposals a verdict since rejected: it yields nothing
                    updates.append(StepUpdate(seq, None, UNFINISHED))
                    continue
            if s.proposal:
                updates.append(self._apply_verified(s, sampled.get(seq.seq_id), (accepted or {}).get(seq.seq_id, [])))
                any_finished |= seq.status is FINISHED
                continue
            if s.samples:
                token = sampled[seq.seq_id]
                seq.num_placeholders -= 1
                seq.token_ids.append(token)
                seq.last_token_unsent = True
                reason = check_stop(seq, self.stop_rules[seq.seq_id], token)
                if seq.constraint is not None and reason == UNFINISHED:
                    reason, error = self.structured.accept(seq, token)
                c.num_generated_tokens += 1
            self.hash_computed(s)
            if not seq.prompt_computed and s.start + s.num_new_tokens >= seq.num_prompt_tokens \
                    and s.epoch == seq.epoch and seq.status is RUNNING:
                seq.prompt_computed = True  # its parallel samples may fork it now
            if reason != UNFINISHED:
                if seq.status is RUNNING:
                    self._release(seq, reason)  # taken out of running below, all at once
                    any_finished = True
                else:  # preempted after this step was sent
                    self.retire(seq, reason)
                c.num_finished += 1
            updates.append(StepUpdate(seq, token, reason, error))
        for search in rounds:
            for member in self.beams.advance(search):  # the members that got their hypotheses
                updates.append(StepUpdate(member, None, member.finish_reason))
                c.num_finished += 1
                c.num_generated_tokens += member.num_output_tokens
        c.num_steps += 1
        if any_finished:
            self.running = [seq for seq in self.running if seq.status is not FINISHED]
        return updates

    def _apply_verified(self, s: ScheduledSeq, token: int | None, accepted: list[int]) -> StepUpdate:
        """A verification's verdict: the accepted proposals, then the token sampled after them, appended one by one
        until one stops the sequence. Their K/V is in the pool (the rejected proposals' slots are rolled back: the
        sequence computes from after its last accepted token on, and lookahead blocks past its tokens go back)."""
        seq, c = s.seq, self.counters
        k = len(s.proposal)
        if token is None:  # the step failed: its requests were aborted
            seq.num_placeholders = max(0, seq.num_placeholders - 1 - k)
            seq.verifying = False
            return StepUpdate(seq, None, seq.finish_reason if seq.status is FINISHED else UNFINISHED)
        seq.num_placeholders -= 1 + k
        current = s.epoch == seq.epoch and seq.status is RUNNING  # not preempted since it was planned
        if len(accepted) < k:  # short: the steps planned on all of them are void, and the count goes back
            for later in seq.steps_in_flight:
                if not later.void:
                    later.void = True
                    seq.num_placeholders -= 1 + len(later.proposal)
            if current:
                seq.num_computed_tokens = s.start + s.num_new_tokens - k + len(accepted)
                seq.start_unsent = True
        seq.verifying = any(p.proposal and not p.void for p in seq.steps_in_flight)
        self.speculator.record(len(s.proposal), len(accepted))
        seq.num_proposed_tokens += len(s.proposal)
        seq.num_accepted_tokens += len(accepted)
        guessed = None if s.guess < 0 else s.start < len(seq.token_ids) and seq.token_ids[s.start] == s.guess
        self.speculator.policy.record(seq, k, len(accepted), guessed)
        reason, new = UNFINISHED, [*accepted, token]
        for n, t in enumerate(new, 1):
            seq.token_ids.append(t)
            reason = check_stop(seq, self.stop_rules[seq.seq_id], t)
            if reason != UNFINISHED:
                new = new[:n]
                break
        seq.last_token_unsent = True
        c.num_generated_tokens += len(new)
        if current:
            self.hash_computed(s, len(new) - 1)  # the accepted proposals' K/V is in the pool
        if reason != UNFINISHED:
            if seq.status is RUNNING:
                self._release(seq, reason)  # taken out of running by the caller
            else:
                self.retire(seq, reason)
            c.num_finished += 1
        elif current:  # not the blocks a step in flight writes (a void one too): another sequence may get them
            self.block_manager.trim(seq, max([len(seq.token_ids)] + [p.start + p.num_new_tokens
                                                                     for p in seq.steps_in_flight]))
            if seq.num_blocks_sent > len(seq.block_table):
                seq.num_blocks_sent = seq.blocks_kept = len(seq.block_table)  # the next plan tells the executors
        return StepUpdate(seq, new[-1], reason, accepted_token_ids=new[:-1])

    @staticmethod
    def check_result(out: SchedulerOutput, sampled: dict[int, int],
                     candidates: dict[int, tuple[list[int], list[float]]] | None = None,
                     accepted: dict[int, list[int]] | None = None) -> None:
        """Raises ValueError for a reply that postprocess() refuses whole, before anything changes."""
        for s in out.scheduled:
            if s.seq.status is FINISHED or not s.samples or s.void:  # aborted while in flight, no sample, or void
                continue
            if s.seq.seq_id not in sampled:
                raise ValueError(f"seq {s.seq.seq_id} reached its end but no token was sampled for it")
            if accepted and s.seq.seq_id in accepted:
                got = accepted[s.seq.seq_id]
                if s.drafted and len(got) > len(s.proposal):  # the executors drew them: only their number is known
                    raise ValueError(f"seq {s.seq.seq_id}: {len(got)} drafted tokens accepted of {len(s.proposal)}")
                if not s.drafted and list(s.proposal[: len(got)]) != list(got):
                    raise ValueError(f"seq {s.seq.seq_id}: accepted tokens {got[:8]} are not a prefix of its proposals")
            if s.seq.beam is not None and (candidates is None or s.seq.seq_id not in candidates):
                raise ValueError(f"beam {s.seq.seq_id} reached its end but no candidates came back for it")

    def accept_ahead(self, out: SchedulerOutput, sampled: dict[int, int], seqs: list[Sequence]) -> None:
        """Advance the matchers of seqs (the next step's late rows) by their tokens of this step, before
        postprocess(out, sampled) applies it: rank 0 waits on their masks (DESIGN.md "Structured output"). Call
        check_result() first. postprocess() then takes each verdict as it stands, advancing no matcher twice."""
        wanted = {seq.seq_id for seq in seqs}
        for s in out.scheduled:
            seq = s.seq
            if s.samples and seq.seq_id in wanted and seq.status is not FINISHED:
                token = sampled[seq.seq_id]  # postprocess checks the stop rules on the token appended, as here
                reason = stop_reason(seq, self.stop_rules[seq.seq_id], token, len(seq.token_ids) + 1)
                self.structured.accept_ahead(seq, token, reason)

    def hash_computed(self, s: ScheduledSeq, num_accepted: int = 0) -> None:
        """Blocks this step filled, with every token known, are now safe to share (invariant 6). Of a verification's
        proposals only the num_accepted leading ones count: the others' slots hold tokens the sequence never had."""
        seq = s.seq
        computed = min(s.start + s.num_new_tokens - len(s.proposal) + num_accepted, len(seq.token_ids))
        if computed // self.config.block_size > len(seq.block_hashes) and seq.status is RUNNING \
                and s.epoch == seq.epoch:
            self.block_manager.hash_full_blocks(seq, computed)

    def stats(self) -> dict:
        """Queue sizes, KV blocks and counters, named as the fields of engine_pb2.SchedulerStats."""
        stats = stats_of(self)
        if self.speculator is not None:
            stats.update(self.speculator.stats())
        return stats

    # ------------------------------------------------------------------ queues (the GroupHost interface)

    def push_waiting(self, seq: Sequence) -> None:
        # A preempted sequence is older than every waiting one of its priority, so it lands at the front.
        seq.status = WAITING
        bisect.insort(self.waiting, seq, key=_queue_order)

    def run_forked(self, seq: Sequence, num_computed_tokens: int) -> None:
        seq.num_computed_tokens = num_computed_tokens
        if not seq.admitted_once:
            seq.admitted_once, seq.num_cached_tokens = True, num_computed_tokens
        seq.status = RUNNING
        self.running.append(seq)  # sent in full with its first step (in_executor is False)

    def running_has_room(self) -> bool:
        return len(self.running) + self.slots_reserved() < self.config.max_num_seqs

    def retire(self, seq: Sequence, reason: int) -> None:
        """The one way a sequence ends (finished, aborted, or a beam no longer needed): out of its queue, its
        blocks back to the pool in this same step (invariant 7), the executors told to drop their mirror."""
        queue = {RUNNING: self.running, WAITING: self.waiting, SWAPPED: self.swapped}.get(seq.status)
        if queue is not None and seq.beam_options is None:  # beam-search members wait outside the queues
            queue.remove(seq)
        self._release(seq, reason)

    def _release(self, seq: Sequence, reason: int) -> None:
        """retire() without taking seq out of its queue: the caller does that."""
        self.block_manager.free(seq)
        seq.status = FINISHED
        seq.finish_reason = reason
        seq.num_placeholders = 0  # samples still in flight for it are discarded
        seq.verifying = False
        seq.steps_in_flight = []
        if self.requests.get(seq.request_key) is seq:
            del self.requests[seq.request_key]
            del self.stop_rules[seq.seq_id]
            if seq.constraint is not None:
                self.structured.release(seq)
            if seq.group_id and seq.beam_options is None:
                self.samples.on_retire(seq)
        if seq.in_executor:
            self.finished_to_drop.append(seq.seq_id)
        self._drop_mirror(seq)

    def preempt(self, seq: Sequence, preempted: list[int]) -> None:
        """Swap it out to the host pool, or preempt by recompute: drop its KV and send it back to waiting (as
        preemption_cost.decide says)."""
        self.running.remove(seq)
        if seq.in_executor:
            preempted.append(seq.seq_id)  # resent in full when it runs again, with its new block table
        self._drop_mirror(seq)
        seq.epoch += 1  # steps in flight wrote blocks it no longer has: they must not hash them
        self.counters.num_preemptions += 1
        steps = [s for s in seq.steps_in_flight if not s.void]
        if steps:  # only the oldest step's inputs are sure to be where they were planned: keep (swap) no more
            seq.num_computed_tokens = steps[0].start + steps[0].num_new_tokens - len(steps[0].proposal)
            seq.start_unsent = False
        decision = self.preemption.decide(seq)
        if decision.swap:
            copies = self.block_manager.swap_out(seq)
            self.pending_swap_outs += copies
            self.preemption.on_swap_out(decision, copies)
            seq.status = SWAPPED
            bisect.insort(self.swapped, seq, key=_queue_order)
            return
        self.preemption.on_recompute(seq, decision)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.prompt_computed = False
        self.push_waiting(seq)

    @staticmethod
    def _drop_mirror(seq: Sequence) -> None:
        seq.in_executor = False
        seq.num_blocks_sent = 0
        seq.last_token_unsent = False
        seq.blocks_kept = -1
        seq.start_unsent = False
