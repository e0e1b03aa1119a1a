"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`.

It starts the real scheduler and executor processes, streams their outputs through the same
detokenizer and stop-string matcher as the gRPC front end, and shuts the processes down on close,
on an exception, on Ctrl-C and at interpreter exit.
"""
from __future__ import annotations

import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from protos import engine_pb2
from scheduler_svc.common.config import EngineConfig
from scheduler_svc.entrypoints.engine_client import EngineClient, EngineError
from scheduler_svc.entrypoints.launcher import EngineProcesses, launch_engine
from scheduler_svc.text.output_tracker import OutputTracker
from scheduler_svc.frontend.sampling_params import SamplingParams
from scheduler_svc.frontend.server_config import RequestLimits
from scheduler_svc.frontend.validation import ValidRequest, validate_request
from scheduler_svc.text.tokenizer import Tokenizer, has_tokenizer

FINISH_REASONS = {
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_ABORT: "abort",
    engine_pb2.FINISH_REASON_ERROR: "error",
}


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[engine_pb2.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # stop, length, abort, error
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    error: str = ""


@dataclass
class GenerationResult:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    num_proposed_tokens: int = 0  # speculative decoding: tokens proposed for its completions, summed
    num_accepted_tokens: int = 0  # of which were accepted
    finished_at: float = 0.0  # time.perf_counter() when its last completion ended (its end-to-end latency's end)


class _Tracker:
    """Accumulates one sub-request's deltas (output_tracker.py) into its CompletionOutput."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams, out: CompletionOutput):
        self.out = out
        self.tracker = OutputTracker(tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output)

    @property
    def done(self) -> bool:
        return self.tracker.done

    @property
    def num_cached_tokens(self) -> int:
        return self.tracker.num_cached_tokens

    def apply(self, ro: engine_pb2.RequestOutput) -> bool:
        """Returns True when a stop string ended it here (the engine must be told to abort)."""
        delta = self.tracker.apply(ro)
        if delta is None:
            return False
        self.out.text += delta.text
        self.out.token_ids.extend(delta.token_ids)
        self.out.logprobs.extend(delta.logprobs)
        if delta.finished:
            self.out.finish_reason = FINISH_REASONS[delta.finish_reason]
            self.out.stop_reason, self.out.error = delta.stop_reason, delta.error
        return delta.stopped_by_string


class LLM:
    def __init__(self, model: str | None = None, *, startup_timeout_s: float = 600.0, log_path: str | None = None,
                 limits: RequestLimits | None = None, **engine_args) -> None:
        self.config = EngineConfig(model=model or "", **engine_args)
        self.limits = limits or RequestLimits()  # the gRPC server's defaults unless given
        # a checkpoint without tokenizer.json still serves token-id prompts (text stays empty)
        self.tokenizer = Tokenizer(self.config.model) if has_tokenizer(self.config.model) else None
        self.processes: EngineProcesses | None = launch_engine(self.config, log_path=log_path)
        self.client = EngineClient(self.processes.frontend_addr, name="llm")
        try:
            self.ready = self.client.wait_ready(startup_timeout_s, self._check_alive)
        except BaseException:
            self.close()
            raise

    @property
    def max_model_len(self) -> int:
        return self.ready.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.ready.model.vocab_size

    def _check_alive(self) -> None:
        dead = self.processes.dead() if self.processes else []
        if dead:
            raise EngineError("engine process exited: " + ", ".join(f"{n} (code {c})" for n, c in dead))

    # ------------------------------------------------------------------ generation

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model} has no tokenizer: pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        return None, ids

    def _validate(self, ids: list[int], params: SamplingParams) -> ValidRequest:
        """The gRPC service's checks and messages (validation.py); raises InvalidArgument, a ValueError."""
        return validate_request(ids, params, self.ready, self.limits)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: int | list[int] = 0,
                 max_concurrency: int | None = None) -> list[GenerationResult]:
        """Generate for a prompt or a list of prompts (text or token ids); results in input order. priority:
        lower is served first (one for all, or one per prompt). max_concurrency: at most this many prompts in the
        engine at once, the next sent as soon as one ends (as that many clients would, each sending its next
        request when its last one is answered); all at once when None."""
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        priorities = priority if isinstance(priority, list) else [priority] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priorities)} priorities")
        results, trackers, requests = [], {}, []
        batch_id = uuid.uuid4().hex[:12]
        prompt_of, open_outputs = {}, []  # sub-request id -> its prompt; each prompt's outputs not yet ended
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            text, ids = self._tokenize(prompt)
            params = self._validate(ids, params).params  # max_tokens set, fitted to this prompt when unset
            result = GenerationResult(f"{batch_id}-{i}", text, ids, [CompletionOutput(j) for j in range(params.n)])
            results.append(result)
            rids = [result.request_id] if params.n == 1 else [f"{result.request_id}#{j}" for j in range(params.n)]
            for rid, out in zip(rids, result.outputs):
                trackers[rid] = (_Tracker(self.tokenizer, ids, params, out), result)
                prompt_of[rid] = i
            open_outputs.append(len(rids))
            # beam search: outputs[j] is the j-th best
            requests.append(params.add_requests(rids, ids, priority=priorities[i]))
        waiting = deque(range(len(requests)))

        def send_next(ended: str | None = None) -> None:  # a prompt's last output ended: its slot takes the next
            if ended is not None:
                open_outputs[prompt_of[ended]] -= 1
                if open_outputs[prompt_of[ended]] or not waiting:
                    return
            for request in requests[waiting.popleft()]:
                self.client.add(request)

        for _ in range(min(max_concurrency or len(requests), len(requests))):
            send_next()
        try:
            self._run(trackers, use_tqdm, send_next)
        except BaseException:
            self.client.abort([rid for rid, (t, _) in trackers.items() if not t.done])
            raise
        for tracker, result in trackers.values():
            result.num_cached_tokens = max(result.num_cached_tokens, tracker.num_cached_tokens)
            result.num_proposed_tokens += tracker.tracker.num_proposed_tokens
            result.num_accepted_tokens += tracker.tracker.num_accepted_tokens
        return results

    def _run(self, trackers: dict, use_tqdm: bool, on_done=lambda request_id: None) -> None:
        from tqdm import tqdm

        pending = set(trackers)
        bar = tqdm(total=len(pending), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        generated, t0 = 0, time.perf_counter()
        try:
            while pending:
                msg = self.client.recv(500)
                if msg is None:
                    self._check_alive()
                    continue
                kind = msg.WhichOneof("kind")
                if kind == "lost":
                    raise EngineError(f"engine lost: {msg.lost.reason}")
                if kind != "outputs":
                    continue
                for ro in msg.outputs.outputs:
                    entry = trackers.get(ro.request_id)
                    if entry is None or entry[0].done:
                        continue
                    tracker, result = entry
                    generated += len(ro.new_token_ids)
                    if tracker.apply(ro):
                        self.client.abort([ro.request_id])
                    if tracker.done:
                        result.finished_at = time.perf_counter()
                        pending.discard(ro.request_id)
                        on_done(ro.request_id)
                        bar.update(1)
                        bar.set_postfix_str(f"{generated / (time.perf_counter() - t0):.1f} tok/s")
        finally:
            bar.close()

    def stats(self) -> engine_pb2.SchedulerStats:
        return self.client.stats()

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
            self.client = None
        if getattr(self, "processes", None) is not None:
            self.processes.shutdown()
            self.processes = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
