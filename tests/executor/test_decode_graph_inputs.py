"""The decode graphs' packed per-row inputs: every field lands where the graph's views read it, and
padding rows write nowhere, read their own zero token and run in place."""
import numpy as np
from hypothesis import given, settings, strategies as st

from executor_svc.cuda_graphs import PADDING, ROW_BYTES, ROW_FIELDS, row_offsets, stage_rows


def _read(raw: np.ndarray, bs: int) -> dict[str, np.ndarray]:
    return {name: raw[off: off + bs * dtype.itemsize].view(dtype)
            for (name, dtype), off in zip(ROW_FIELDS, row_offsets(bs).values())}


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_packed_rows_round_trip_with_padding(data):
    bs = data.draw(st.integers(1, 64))
    b = data.draw(st.integers(0, bs))
    capacity = data.draw(st.integers(bs, 128))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    rows = {name: rng.integers(-1000, 1000, size=b).astype(dtype) for name, dtype in ROW_FIELDS}
    if data.draw(st.booleans()):  # rows that leave sampling to the eager sampler send no sampling columns
        del rows["temperature"], rows["noise_seeds"]
    raw = rng.integers(0, 256, size=bs * ROW_BYTES + 7, dtype=np.uint8)  # stale bytes everywhere
    assert stage_rows(raw, bs, b, rows, capacity) == bs * ROW_BYTES
    got = _read(raw, bs)
    for name, dtype in ROW_FIELDS:
        want_rows = rows[name] if name in rows else np.full(b, PADDING[name], dtype)
        np.testing.assert_array_equal(got[name][:b], want_rows, err_msg=name)
    pad = slice(b, bs)
    np.testing.assert_array_equal(got["gather"][pad], np.arange(capacity + b, capacity + bs))
    np.testing.assert_array_equal(got["decode_order"][pad], np.arange(b, bs))
    assert (got["slot_mapping"][pad] == -1).all() and (got["seqlens_k"][pad] == 1).all()
    assert (got["tokens"][pad] == 0).all() and (got["temperature"][pad] == 1.0).all()


def test_fields_are_aligned_and_disjoint_for_every_bucket_size():
    for bs in range(1, 80):
        spans = []
        for (name, dtype), off in zip(ROW_FIELDS, row_offsets(bs).values()):
            assert off % dtype.itemsize == 0, (bs, name)
            spans.append((off, off + bs * dtype.itemsize))
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
        assert spans[-1][1] == bs * ROW_BYTES
