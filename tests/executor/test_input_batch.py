"""A step's chunks as host arrays: each token's position and slot come from its own sequence's
block table, no two tokens of a step share a slot, and the sampled rows are the chunks' last tokens."""
import numpy as np
from hypothesis import given, settings, strategies as st

from executor_svc.input_batch import host_inputs, one_token_chunks_first
from executor_svc.sampling_row import GREEDY_ROW
from executor_svc.seq_mirror import MirroredSeq, ScheduledChunk


@st.composite
def steps(draw):
    """Sequences on disjoint random blocks, each computing some tokens [start, end) of its own."""
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_seqs = draw(st.integers(1, 6))
    lengths = [draw(st.integers(1, 40)) for _ in range(num_seqs)]
    needs = [-(-n // block_size) for n in lengths]
    blocks = draw(st.permutations(range(sum(needs) + 4)))
    chunks, at = [], 0
    for i, (n, nb) in enumerate(zip(lengths, needs)):
        start = draw(st.integers(0, n - 1))
        end = draw(st.integers(start + 1, n))
        seq = MirroredSeq(i, list(range(100 * i, 100 * i + n)), 1, list(blocks[at: at + nb]), start, GREEDY_ROW)
        at += nb
        chunks.append(ScheduledChunk(seq, start, end))
    return block_size, chunks


@settings(max_examples=80, deadline=None)
@given(steps())
def test_every_token_goes_to_its_own_block_at_its_offset_and_no_slot_is_shared(step):
    block_size, chunks = step
    host = host_inputs(chunks, block_size, prev_rows={})
    a = host.arrays
    want_ids, want_pos, want_slots, want_logits = [], [], [], []
    for c in chunks:
        for pos in range(c.start, c.end):
            want_ids.append(c.seq.token_ids[pos])
            want_pos.append(pos)
            want_slots.append(c.seq.block_table[pos // block_size] * block_size + pos % block_size)
        if c.samples:
            want_logits.append(len(want_ids) - 1)
    np.testing.assert_array_equal(a["input_ids"], want_ids)
    np.testing.assert_array_equal(a["positions"], want_pos)
    np.testing.assert_array_equal(a["slot_mapping"], want_slots)
    assert len(set(want_slots)) == len(want_slots)
    np.testing.assert_array_equal(a["logits_indices"], want_logits)
    assert [id(c) for c in host.sampling_chunks] == [id(c) for c in chunks if c.samples]
    np.testing.assert_array_equal(a["cu_seqlens_q"], np.cumsum([0] + [c.end - c.start for c in chunks]))
    np.testing.assert_array_equal(a["seqlens_k"], [c.end for c in chunks])
    for row, c in zip(a["block_tables"], chunks):
        used = -(-c.end // block_size)
        assert list(row[:used]) == c.seq.block_table[:used] and not row[used:].any()


@settings(max_examples=60, deadline=None)
@given(steps())
def test_one_token_chunks_lead_and_decode_longest_context_first(step):
    block_size, chunks = step
    ordered = one_token_chunks_first(chunks)
    assert sorted(id(c) for c in ordered) == sorted(id(c) for c in chunks)
    host = host_inputs(ordered, block_size, prev_rows={})
    num_ones = sum(c.end - c.start == 1 for c in chunks)
    assert all(c.end - c.start == 1 for c in ordered[:num_ones])
    assert host.num_decodes == num_ones
    if host.num_decodes:
        contexts = [ordered[i].end for i in host.arrays["decode_order"]]
        assert contexts == sorted(contexts, reverse=True)
        assert sorted(host.arrays["decode_order"]) == list(range(host.num_decodes))
