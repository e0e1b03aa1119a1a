"""Tokenizer and chat template, with the `tokenizers` library and jinja2 (no transformers, no torch)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


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
        self.hf = HFTokenizer.from_file(path)
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

    def encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        # the template already holds the special tokens it wants
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)
