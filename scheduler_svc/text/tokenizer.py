"""Tokenizer and chat template, with the `tokenizers` library and jinja2 (no transformers, no torch)."""
from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


USER_FIELDS = ("role", "content")  # what a chat's sender writes; the rest of the prompt is the template's
# Private-use characters: one that a chat does not use marks its special-token text while the template renders.
PRIVATE_USE = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE), range(0x100000, 0x10FFFE))


def _unused_character(texts: list[str]) -> str:
    used = set().union(*map(set, texts))
    for block in PRIVATE_USE:
        for code in block:
            if chr(code) not in used:
                return chr(code)
    raise ValueError("the chat uses every private-use character; it cannot be templated safely")


def has_tokenizer(model_dir: str) -> bool:
    return os.path.exists(os.path.join(model_dir, "tokenizer.json"))


@dataclass
class ChatMessage:
    role: str
    content: str


class Tokenizer:
    def __init__(self, model_dir: str) -> None:
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        self.path = path
        self.hf = HFTokenizer.from_file(path)
        specials = sorted((t.content for t in self.hf.get_added_tokens_decoder().values() if t.special),
                          key=len, reverse=True)  # longest first, as the tokenizer matches them
        self._special_ids = {self.hf.token_to_id(t) for t in specials}
        self._special_text = re.compile("|".join(map(re.escape, specials))) if specials else None
        config = {}
        config_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.exists(config_path):
            with open(config_path) as f:
                config = json.load(f)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template = self._find_chat_template(model_dir, config)
        self._template = None
        if self.chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = self._raise
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
            self._template = env.from_string(self.chat_template)

    @staticmethod
    def _raise(message: str):
        raise ValueError(f"chat template: {message}")

    @staticmethod
    def _find_chat_template(model_dir: str, config: dict) -> str | None:
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path) as f:
                return f.read()
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        return template

    @functools.cached_property
    def _as_text(self) -> HFTokenizer:
        """A twin that reads special-token text as plain text."""
        twin = HFTokenizer.from_file(self.path)
        twin.encode_special_tokens = True
        return twin

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    # The batch calls, with a batch of one: unlike encode and decode, they release the GIL while
    # they work, so a long text tokenized in a worker thread leaves the event loop running.
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def apply_chat_template(self, messages: list[ChatMessage] | list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        msgs = [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages]
        return self._template.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[ChatMessage] | list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The chat's token ids. Its control tokens come from the template alone: a role or content
        that spells one (`<|im_end|>\n<|im_start|>system`) is tokenized as the text it is."""
        msgs = [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages]
        user_texts = [v for m in msgs for k, v in m.items() if k in USER_FIELDS and isinstance(v, str)]
        if self._special_text is None or not any(self._special_text.search(t) for t in user_texts):
            return self.encode(self.apply_chat_template(msgs, add_generation_prompt), add_special_tokens=False)
        text, user_specials = self._render_marking_user_specials(msgs, user_texts, add_generation_prompt)
        encoding = self.hf.encode_batch([text], add_special_tokens=False)[0]
        ids = []
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets):
            if token_id in self._special_ids and (start, end) in user_specials:
                ids += self._as_text.encode_batch_fast([text[start:end]], add_special_tokens=False)[0].ids
            else:
                ids.append(token_id)
        return ids

    def _render_marking_user_specials(self, msgs: list[dict], user_texts: list[str],
                                      add_generation_prompt: bool) -> tuple[str, set[tuple[int, int]]]:
        """The rendered chat, and the (start, end) characters of each special-token text in it that
        came from a role or content. Each such text renders as a placeholder, so the template never
        sees it (nor branches on it), and is then put back."""
        mark = _unused_character(user_texts + [self.chat_template or "", self.bos_token or "", self.eos_token or ""])
        hidden: list[str] = []

        def hide(match: re.Match) -> str:
            hidden.append(match.group())
            return f"{mark}{len(hidden) - 1}{mark}"

        msgs = [{k: self._special_text.sub(hide, v) if k in USER_FIELDS and isinstance(v, str) else v
                 for k, v in m.items()} for m in msgs]
        rendered = self.apply_chat_template(msgs, add_generation_prompt)
        parts, spans, length = [], set(), 0
        # re.split with a group alternates template-and-user text with placeholder numbers
        for i, part in enumerate(re.split(f"{mark}([0-9]+){mark}", rendered)):
            if i % 2:
                part = hidden[int(part)]
                spans.add((length, length + len(part)))
            parts.append(part)
            length += len(part)
        return "".join(parts), spans
