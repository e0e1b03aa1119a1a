"""Prompts are tokenized off the event loop, a few at a time, and only up to --max-prompt-bytes.

Tokenizing takes about a second per MiB of text on one core. On the event loop that second would
stall every stream of the server; in a worker thread it does not, because `tokenizers` releases
the GIL while it encodes. The number of threads bounds how many prompts are tokenized at once, and
so the memory their encodings hold; the byte limit bounds each one.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools

from scheduler_svc.frontend.validation import InvalidArgument


def input_bytes(request) -> tuple[str, int]:
    """(field, UTF-8 bytes) of the text a GenerateRequest or TokenizeRequest asks to tokenize."""
    kind = request.WhichOneof("input")
    if kind == "messages":
        return kind, sum(len(m.role.encode()) + len(m.content.encode()) for m in request.messages.messages)
    if kind in ("prompt", "text"):
        return kind, len(getattr(request, kind).encode())
    return kind or "input", 0  # token ids, or nothing: no text to tokenize


def check_input_size(request, max_prompt_bytes: int) -> None:
    """Checked before tokenizing, so an oversized prompt costs no tokenizer time."""
    field, size = input_bytes(request)
    if size > max_prompt_bytes:
        what = "roles and contents" if field == "messages" else "text"
        raise InvalidArgument(f"{field}: {size} bytes of {what} (UTF-8); the limit is "
                              f"--max-prompt-bytes = {max_prompt_bytes}")


class TokenizerThreads:
    """A fixed number of worker threads; more requests wait their turn in its queue."""

    def __init__(self, threads: int) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tokenizer")

    async def run(self, fn, *args):
        """fn(*args) in a worker thread; its result, or the exception it raised."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
