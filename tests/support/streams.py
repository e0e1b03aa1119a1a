"""Many GenerateStream calls at once, each read by its own thread, recording when and how each ended."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import grpc

from protos import generation_pb2 as pb
from protos import generation_pb2_grpc


@dataclass
class StreamEnd:
    code: grpc.StatusCode  # OK when the stream finished normally
    at: float  # time.monotonic() when the end reached the client
    num_tokens: int
    details: str = ""


class ConcurrentStreams:
    """n greedy streams of the same prompt that ignore EOS, so each runs for max_tokens tokens."""

    def __init__(self, channel: grpc.Channel, n: int, prompt_token_ids: list[int], max_tokens: int,
                 timeout_s: float = 600.0) -> None:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt_token_ids), sampling=pb.SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True))
        self.calls = [stub.GenerateStream(request, timeout=timeout_s) for _ in range(n)]
        self.tokens = [0] * n
        self.ends: list[StreamEnd | None] = [None] * n
        self._changed = threading.Condition()
        self.threads = [threading.Thread(target=self._read, args=(i,), daemon=True) for i in range(n)]
        for thread in self.threads:
            thread.start()

    def _read(self, i: int) -> None:
        end = StreamEnd(grpc.StatusCode.OK, 0.0, 0)
        try:
            for response in self.calls[i]:
                with self._changed:
                    self.tokens[i] += sum(len(out.token_ids) for out in response.outputs)
                    self._changed.notify_all()
        except grpc.RpcError as exc:
            end = StreamEnd(exc.code(), 0.0, 0, exc.details() or "")
        with self._changed:
            end.at, end.num_tokens = time.monotonic(), self.tokens[i]
            self.ends[i] = end
            self._changed.notify_all()

    def _wait(self, condition, timeout: float, what: str) -> None:
        with self._changed:
            if not self._changed.wait_for(condition, timeout):
                raise AssertionError(f"{what} within {timeout:.0f}s: tokens {self.tokens}, ends {self.ends}")

    def wait_all_streaming(self, min_tokens: int, timeout: float) -> None:
        """Until every stream has received min_tokens tokens and none has ended."""
        self._wait(lambda: all(t >= min_tokens for t in self.tokens) or any(self.ends), timeout,
                   f"not every stream got {min_tokens} tokens")
        assert not any(self.ends), f"a stream ended early: {self.ends}"

    def wait_all_ended(self, timeout: float) -> list[StreamEnd]:
        self._wait(lambda: all(self.ends), timeout, "not every stream ended")
        return list(self.ends)

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()
        for thread in self.threads:
            thread.join(10)
