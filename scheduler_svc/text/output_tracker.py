"""One engine sequence's outputs turned into text deltas, with stop strings applied.

Shared by the offline LLM API and the gRPC front end, so both produce the same text: the
incremental detokenizer keeps multi-byte characters whole, and the stop-string matcher holds back
text that may start a stop string, so the deltas always concatenate to the final text.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from protos import engine_pb2
from scheduler_svc.text.detokenizer import IncrementalDetokenizer
from scheduler_svc.text.stop_strings import StopStringMatcher
from scheduler_svc.text.tokenizer import Tokenizer


@dataclass
class Delta:
    """What one RequestOutput added to a completion."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[engine_pb2.TokenLogprobs] = field(default_factory=list)
    finish_reason: int = engine_pb2.FINISH_REASON_UNSPECIFIED  # engine_pb2.FinishReason; set on the last delta
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    error: str = ""  # why, when finish_reason is ERROR
    stopped_by_string: bool = False  # the engine still runs it: the caller must abort it there

    @property
    def finished(self) -> bool:
        return self.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED


class OutputTracker:
    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: list[int], stop: list[str],
                 include_stop_str_in_output: bool = False) -> None:
        # without a tokenizer (a bare checkpoint) only token ids are produced
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids) if tokenizer else None
        self.stops = StopStringMatcher(stop, include_stop_str_in_output)
        self.done = False
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_cached_tokens = 0
        self.num_tokens = 0
        self.num_proposed_tokens = 0  # speculative decoding, told with the final output
        self.num_accepted_tokens = 0

    def apply(self, ro: engine_pb2.RequestOutput) -> Delta | None:
        """The delta of one engine output; None once the completion has ended."""
        if self.done:
            return None
        self.num_cached_tokens = ro.num_cached_tokens
        if ro.num_proposed_tokens:
            self.num_proposed_tokens, self.num_accepted_tokens = ro.num_proposed_tokens, ro.num_accepted_tokens
        delta = Delta(token_ids=list(ro.new_token_ids), logprobs=list(ro.logprobs))
        engine_done = ro.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED
        if self.detok is not None:
            if len(delta.token_ids) > 1 and self.stops.active:
                delta.text = self._feed_until_stop(delta)
            elif delta.token_ids:
                delta.text = self.stops.feed(self.detok.add(delta.token_ids))
            if engine_done and self.stops.matched is None:
                delta.text += self.stops.feed(self.detok.flush())
        if self.stops.matched is not None:
            delta.finish_reason, delta.stop_reason = engine_pb2.FINISH_REASON_STOP, self.stops.matched
            delta.stopped_by_string = not engine_done
        elif engine_done:
            delta.text += self.stops.flush()
            delta.finish_reason, delta.error = ro.finish_reason, ro.error
            if ro.stop_token_id >= 0:
                delta.stop_reason = ro.stop_token_id
        self.num_tokens += len(delta.token_ids)
        self.done = delta.finished
        return delta

    def _feed_until_stop(self, delta: Delta) -> str:
        """Several tokens at once (a beam search's hypothesis): the ones after a stop string's match are cut."""
        text = []
        for i, token in enumerate(delta.token_ids):
            text.append(self.stops.feed(self.detok.add([token])))
            if self.stops.matched is not None:
                del delta.token_ids[i + 1:], delta.logprobs[i + 1:]
                break
        return "".join(text)
