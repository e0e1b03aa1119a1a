"""The model's tokenizer files as one zip, for a gateway that has no copy of the model (SMG's GetTokenizer):
sent in chunks, the zip's sha256 on the last one."""
from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

# What a tokenizer and its chat template are made of (Hugging Face's names); the ones the model has go in.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json", "config.json", "vocab.json", "merges.txt",
                   "added_tokens.json", "tokenizer.model")
CHUNK_BYTES = 1 << 20


def tokenizer_zip(model_dir: str | Path) -> bytes:
    """The tokenizer files of model_dir, zipped flat; ValueError when it has no tokenizer.json."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        raise ValueError(f"{model_dir} has no tokenizer.json")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                archive.write(model_dir / name, arcname=name)
    return buffer.getvalue()


def chunks(data: bytes, chunk_bytes: int = CHUNK_BYTES) -> list[tuple[bytes, str]]:
    """(bytes, sha256) pairs to send in order: the digest of the whole on the last chunk, empty before."""
    parts = [data[i:i + chunk_bytes] for i in range(0, len(data), chunk_bytes)] or [b""]
    digest = hashlib.sha256(data).hexdigest()
    return [(part, digest if i == len(parts) - 1 else "") for i, part in enumerate(parts)]
