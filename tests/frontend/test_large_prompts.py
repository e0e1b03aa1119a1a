"""Large prompts: above --max-prompt-bytes a prompt is INVALID_ARGUMENT naming the flag and the limit,
the gRPC receive limit follows that flag, and a prompt being tokenized does not stall the server:
tokenization runs off the event loop, a few prompts at a time."""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from protos import generation_pb2 as pb
from scheduler_svc.frontend.server_config import RequestLimits, ServerConfig
from scheduler_svc.text.tokenizer import Tokenizer
from support.frontend_in_process import serve_frontend

LIMIT = 1000
SENTENCE = "The quick brown fox jumps over the lazy dog, and then it naps in the sun. "


@pytest.fixture(scope="module")
def tokenizer(embedded_model) -> Tokenizer:
    return Tokenizer(embedded_model)


def config(max_prompt_bytes: int | None = None, **kwargs) -> ServerConfig:
    limits = RequestLimits() if max_prompt_bytes is None else RequestLimits(max_prompt_bytes=max_prompt_bytes)
    return ServerConfig(limits=limits, **kwargs)


def chat(content: str, role: str = "user") -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role=role, content=content)])


async def call(frontend, method: str, request):
    async with frontend.channel() as channel:
        return await getattr(frontend.stub(channel), method)(request, timeout=60)


async def status_of(frontend, method: str, request) -> tuple[grpc.StatusCode, str]:
    try:
        await call(frontend, method, request)
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details()
    return grpc.StatusCode.OK, ""


OVER_THE_LIMIT = [
    ("Generate", pb.GenerateRequest(prompt="a" * (LIMIT + 1))),
    ("Generate", pb.GenerateRequest(messages=chat("é" * (LIMIT // 2)))),  # 500 characters, 1004 bytes with the role
    ("Tokenize", pb.TokenizeRequest(text="a" * (LIMIT + 1))),
    ("Tokenize", pb.TokenizeRequest(messages=pb.ChatMessages(messages=[
        pb.ChatMessage(role="system", content="s" * (LIMIT // 2)), pb.ChatMessage(role="user", content="u" * 494)]))),
]


@pytest.mark.parametrize("method, request_", OVER_THE_LIMIT, ids=["prompt", "chat", "tokenize text", "tokenize chat"])
def test_a_prompt_over_max_prompt_bytes_is_invalid_argument_naming_the_flag_and_the_limit(tokenizer, method, request_):
    async def main():
        async with serve_frontend(config(LIMIT), tokenizer) as frontend:
            return await status_of(frontend, method, request_)

    code, details = asyncio.run(main())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "--max-prompt-bytes" in details and str(LIMIT) in details


def test_a_prompt_of_exactly_max_prompt_bytes_is_tokenized(tokenizer):
    text = ("ab " * LIMIT)[:LIMIT]

    async def main():
        async with serve_frontend(config(LIMIT), tokenizer) as frontend:
            return await call(frontend, "Tokenize", pb.TokenizeRequest(text=text, add_special_tokens=False))

    assert list(asyncio.run(main()).token_ids) == tokenizer.encode(text, add_special_tokens=False)


def test_the_receive_limit_follows_max_prompt_bytes():
    """A message a little over the prompt limit reaches the service, which names the flag; one far
    over it is refused by gRPC before it is read whole."""
    async def main(cfg: ServerConfig, over: int):
        async with serve_frontend(cfg, None) as frontend:
            return [await status_of(frontend, "Generate", pb.GenerateRequest(prompt="a" * size))
                    for size in (cfg.limits.max_prompt_bytes + 1, over)]

    for cfg in (config(LIMIT), config()):
        just_over, far_over = asyncio.run(main(cfg, over=cfg.limits.max_prompt_bytes + 3 * 2**20))
        assert just_over[0] == grpc.StatusCode.INVALID_ARGUMENT and "--max-prompt-bytes" in just_over[1]
        assert far_over[0] == grpc.StatusCode.RESOURCE_EXHAUSTED, far_over


def test_the_default_prompt_limit_is_a_mebibyte_and_the_flag_sets_it():
    import argparse

    from scheduler_svc.frontend.server_config import add_server_args, server_config_from_args

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert server_config_from_args(parser.parse_args([])).limits.max_prompt_bytes == 2**20
    assert server_config_from_args(parser.parse_args(["--max-prompt-bytes", "5000"])).limits.max_prompt_bytes == 5000
    with pytest.raises(ValueError, match="--max-prompt-bytes"):
        server_config_from_args(parser.parse_args(["--max-prompt-bytes", "0"]))


class EncodeSpy:
    """Wraps Tokenizer.encode: tells when a large input starts and ends, and how many run at once."""

    def __init__(self, encode, hold_s: float = 0.0) -> None:
        self.encode, self.hold_s = encode, hold_s
        self.large_started, self.large_finished = threading.Event(), threading.Event()
        self.running = self.most_at_once = 0
        self.lock = threading.Lock()

    def __call__(self, text: str, *args, **kwargs):
        large = len(text) > 10_000
        with self.lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        if large:
            self.large_started.set()
        try:
            time.sleep(self.hold_s)  # stands for a longer text; sleeps off the GIL, as the tokenizer does
            return self.encode(text, *args, **kwargs)
        finally:
            with self.lock:
                self.running -= 1
            if large:
                self.large_finished.set()


def test_other_calls_are_answered_while_a_large_prompt_is_tokenized(tokenizer, monkeypatch):
    spy = EncodeSpy(tokenizer.encode)
    monkeypatch.setattr(tokenizer, "encode", spy)
    large = (SENTENCE * (2**20 // len(SENTENCE)))[:2**20 - 10]  # just under the default limit: ~0.8 s on one core

    async def main():
        async with serve_frontend(config(), tokenizer) as frontend, frontend.channel() as channel:
            stub = frontend.stub(channel)
            big = asyncio.ensure_future(stub.Generate(pb.GenerateRequest(prompt=large), timeout=120))
            assert await asyncio.to_thread(spy.large_started.wait, 60)
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
            small = await stub.Tokenize(pb.TokenizeRequest(text="Hello there"), timeout=60)
            answered_during = not spy.large_finished.is_set()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await big
            return info, small, answered_during, err.value

    info, small, answered_during, big_error = asyncio.run(main())
    assert info.max_model_len == 512 and list(small.token_ids) == spy.encode("Hello there")
    assert answered_during, "the event loop waited for the large prompt's tokenization"
    # the large prompt itself was tokenized and then measured against the context
    assert big_error.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len = 512" in big_error.details()


def test_at_most_tokenizer_threads_prompts_are_tokenized_at_once(tokenizer, monkeypatch):
    spy = EncodeSpy(tokenizer.encode, hold_s=0.3)
    monkeypatch.setattr(tokenizer, "encode", spy)
    texts = [f"{i}: {SENTENCE}" for i in range(6)]

    async def main():
        async with serve_frontend(config(tokenizer_threads=2), tokenizer) as frontend, frontend.channel() as channel:
            stub = frontend.stub(channel)
            return await asyncio.gather(*(stub.Tokenize(pb.TokenizeRequest(text=t), timeout=60) for t in texts))

    replies = asyncio.run(main())
    assert [list(r.token_ids) for r in replies] == [spy.encode(t) for t in texts]
    assert spy.most_at_once == 2
