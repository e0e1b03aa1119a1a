"""The sampling flags shared by `nanoserve generate` (offline) and `nanoserve client generate|chat`."""
from __future__ import annotations

import argparse


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=None, help="default 256, cut to fit max_model_len")
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--n", type=int, default=1, help="samples per prompt")
    g.add_argument("--logprobs", type=int, default=0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--beam-width", type=int, default=0, help="beam search with this many beams; 0 samples")
    g.add_argument("--length-penalty", type=float, default=1.0, help="beam search: score / length ** this")
    g = parser.add_argument_group("structured output").add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="FILE", type=_file_text, default=None,
                   help="the output is JSON valid under the JSON Schema in FILE")
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    g.add_argument("--regex", default=None, help="the whole output matches this regular expression")
    g.add_argument("--grammar", metavar="FILE", type=_file_text, default=None,
                   help="the output follows the grammar in FILE (llguidance's Lark-like syntax)")
    g.add_argument("--choice", action="append", default=None, help="the output is one of these (repeatable)")


def _file_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror}") from None


def constraint_from_args(args: argparse.Namespace) -> dict:
    """The structured-output fields of SamplingParams that the flags set (argparse allows at most one)."""
    found = {k: getattr(args, k) for k in ("json_schema", "regex", "grammar", "choice") if getattr(args, k) is not None}
    return {**found, "json_object": True} if args.json_object else found
