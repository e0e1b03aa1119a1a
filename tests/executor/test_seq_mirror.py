"""The executor's sequence mirrors are plain Python and numpy: a tool that replays plans (such as
bench/scheduler_overhead.py) imports them without torch."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_sequence_mirrors_never_imports_torch():
    probe = ("import sys; import executor_svc.seq_mirror; "
             "leaked = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
             "sys.exit(f'torch imported: {leaked[:3]}' if leaked else 0)")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_draft_proposes_after_a_decode_and_its_verdict_sets_what_the_draft_pool_holds():
    """The draft computed the chunk's input and its proposals but the last: after a verdict accepting a of K, its
    K/V holds the first start + 1 + min(a, K - 1) tokens; the rest it catches up on next time."""
    import pytest

    from executor_svc.seq_mirror import SequenceMirrors
    from protos import engine_pb2

    mirrors = SequenceMirrors()
    new = engine_pb2.NewSequence(seq_id=1, token_ids=[5, 6, 7, 8, 9], num_prompt_tokens=5, block_ids=[0, 1],
                                 num_scheduled_tokens=5, sampling=engine_pb2.SamplingOptions())
    (chunk,) = mirrors.apply(engine_pb2.StepPlan(step_id=1, new_seqs=[new]))
    mirrors.commit([chunk])
    mirrors.append_sampled(1, 10)
    seq = mirrors.seqs[1]
    assert seq.draft_computed == 0  # a new mirror: the draft has computed nothing of it

    def draft_step(step_id: int, k: int, accepted: list[int], token: int, start: int = -1) -> None:
        """start: the scheduler's corrected count after a short verdict (chunk_starts)."""
        plan = engine_pb2.StepPlan(step_id=step_id, cached=engine_pb2.CachedSequences(
            seq_ids=[1], num_scheduled_tokens=[1 + k], num_new_blocks=[0], last_token_ids=[-1],
            num_draft_tokens=[k], guessed_token_ids=[-1], chunk_starts=[start]))
        (c,) = mirrors.apply(plan)
        assert (c.num_draft, c.num_proposed, c.samples, c.proposal) == (k, k, True, ())
        c.proposal = [20 + j for j in range(k)]  # what DraftModel.propose fills in
        seq.draft_computed = c.start + 1  # (its catch-up)
        mirrors.commit([c])
        mirrors.append_sampled(1, token, accepted)

    draft_step(2, 3, [20, 21], 30)  # start 5: d1, d2 accepted (their draft K/V is right), d3 rejected
    assert seq.token_ids[5:] == [10, 20, 21, 30] and seq.draft_computed == 5 + 1 + 2
    draft_step(3, 2, [20, 21], 31, start=8)  # start 8, every proposal accepted: the last was never fed to the draft
    assert seq.draft_computed == 8 + 1 + 1 and len(seq.token_ids) == 12
    bad = engine_pb2.StepPlan(step_id=4, cached=engine_pb2.CachedSequences(
        seq_ids=[1], num_scheduled_tokens=[1], num_new_blocks=[0], last_token_ids=[-1], num_draft_tokens=[2]))
    with pytest.raises(RuntimeError, match="cannot compute"):
        mirrors.apply(bad)
