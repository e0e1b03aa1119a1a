"""The front end's text from engine outputs (output_tracker.py): deltas, however the tokens are
chunked, concatenate to the decoded text, cut before the first stop string."""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos import engine_pb2
from scheduler_svc.common.model_paths import default_model_dir
from scheduler_svc.text.output_tracker import OutputTracker
from scheduler_svc.text.tokenizer import Tokenizer

# Multi-byte characters split over byte-level BPE tokens are the hard case.
TEXTS = ["Paris is the capital of France.", "Zürich café — naïve résumé", "emoji 👋🏽 and 漢字 and ∑x²",
         "stop here STOP and more", "a\nb\n\nc  d"]


@pytest.fixture(scope="module")
def tokenizer():
    path = default_model_dir()
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        pytest.fail(f"embedded model missing at {path}: run `make model`")
    return Tokenizer(path)


def outputs(ids: list[int], cuts: list[int], finish_reason: int):
    """ids as RequestOutputs split at cuts; the last one carries finish_reason."""
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    chunks = [ids[a:b] for a, b in zip(bounds, bounds[1:])]
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        yield engine_pb2.RequestOutput(request_id="r", new_token_ids=chunk, stop_token_id=-1,
                                       finish_reason=finish_reason if last else engine_pb2.FINISH_REASON_UNSPECIFIED)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.sampled_from(TEXTS), cuts=st.lists(st.integers(0, 200), max_size=8),
       stop_len=st.integers(0, 4), stop_at=st.integers(0, 100))
def test_deltas_concatenate_to_the_text_cut_at_the_first_stop_string(tokenizer, text, cuts, stop_len, stop_at):
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    full = tokenizer.decode(ids)
    start = stop_at % len(full)
    stop = full[start:start + stop_len] if stop_len else ""
    tracker = OutputTracker(tokenizer, prompt, [stop] if stop else [])
    pieces, last = [], None
    for ro in outputs(ids, cuts, engine_pb2.FINISH_REASON_LENGTH):
        delta = tracker.apply(ro)
        if delta is not None:
            pieces.append(delta.text)
            last = delta
    assert tracker.done and last.finished
    if stop:
        cut = full.find(stop)
        assert "".join(pieces) == full[:cut]
        assert last.finish_reason == engine_pb2.FINISH_REASON_STOP and last.stop_reason == stop
    else:
        assert "".join(pieces) == full
        assert last.finish_reason == engine_pb2.FINISH_REASON_LENGTH and last.stop_reason is None
    assert all("\ufffd" not in p for p in pieces)


def test_a_stop_string_mid_stream_asks_for_an_abort_and_ignores_later_outputs(tokenizer):
    ids = tokenizer.encode("one two three four five", add_special_tokens=False)
    tracker = OutputTracker(tokenizer, [1], ["three"], include_stop_str_in_output=True)
    texts = []
    for token in ids:
        delta = tracker.apply(engine_pb2.RequestOutput(request_id="r", new_token_ids=[token], stop_token_id=-1))
        if delta is None:
            break
        texts.append(delta.text)
        if delta.finished:
            assert delta.stopped_by_string and delta.stop_reason == "three"
    assert "".join(texts) == "one two three"
    assert tracker.apply(engine_pb2.RequestOutput(request_id="r", finish_reason=engine_pb2.FINISH_REASON_ABORT)) is None


def test_an_engine_error_is_the_last_delta_with_its_cause(tokenizer):
    tracker = OutputTracker(tokenizer, [1], [])
    delta = tracker.apply(engine_pb2.RequestOutput(request_id="r", finish_reason=engine_pb2.FINISH_REASON_ERROR,
                                                   error="engine lost: gone", stop_token_id=-1))
    assert delta.finish_reason == engine_pb2.FINISH_REASON_ERROR and delta.error == "engine lost: gone"
    assert tracker.done
