"""Serve from another source tree (bench/serving.py --server-tree DIR), under this tree's load and probe.

The tree's `nanoserve serve` runs with cwd and PYTHONPATH at DIR (this repo taken off PYTHONPATH), so that
its own packages, and its children's, are imported, from its own CLI module: scheduler_svc.cli up to
a22f1ae (2026-11-30), scheduler_svc.entrypoints.cli since the reorganisation of 2026-12-01 (fdd2e3b).

Its flags: the engine flags go as this tree's EngineConfig.to_argv(), less those the tree's `serve --help`
does not list. Such a flag is dropped when it holds this tree's default (the older tree then runs as it
always did); one set to anything else stops the run, since the tree cannot do what was asked.

Its messages are parsed with this tree's stubs, which is sound only where both .proto files agree:
check_protos() compares every field the tree's protos/*.proto declares (number, name, type, repeated)
with this tree's descriptors, and refuses the tree on any clash. For a22f1ae it finds none: since then
engine.proto and generation.proto only gained fields (SchedulerStats 1-22 and Stats 1-14 are unchanged,
SchedulerStats 23-42 and Stats 15-28 are new) and messages, the FinishReason enums are unchanged, and
AddRequest.arrival_time (6) became reserved, a field the bench never sets. A counter only this tree has reads
0 from an older server, so lacking_counters() names those among bench/serving_probe.py's, for the probe to
leave out (none for a22f1ae). Their meaning was read, not only their numbers: a22f1ae's scheduler already
summed StepResult.execute_seconds / idle_seconds into executor_busy / idle_seconds, and the wall time of
each step from the later of its launch and the previous reply into prefill / decode_step_seconds, as now.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from dataclasses import dataclass

from google.protobuf import descriptor_pb2

from protos import engine_pb2, generation_pb2
from scheduler_svc.common.config import EngineConfig

CLI_MODULES = ("scheduler_svc.entrypoints.cli", "scheduler_svc.cli")  # now; up to a22f1ae (2026-11-30)
_FIELD = re.compile(r"^\s*(repeated\s+|optional\s+)?([\w.]+)\s+(\w+)\s*=\s*(\d+)\s*[;\[]", re.M)
_ENUM_VALUE = re.compile(r"^\s*(\w+)\s*=\s*(-?\d+)\s*[;\[]", re.M)
_BLOCK = re.compile(r"^(message|enum)\s+(\w+)\s*\{(.*?)^\}", re.M | re.S)  # top-level blocks: none are nested


@dataclass
class ServerTree:
    root: str
    cli_module: str
    serve_flags: frozenset[str]  # every option string of its `serve --help`
    lacking: tuple[str, ...]  # of the probe's counters, those its scheduler does not have


def cli_module(root: str) -> str:
    for module in CLI_MODULES:
        if os.path.exists(os.path.join(root, *module.split(".")) + ".py"):
            return module
    raise SystemExit(f"--server-tree {root}: no {' or '.join(CLI_MODULES)} in it")


def tree_env(root: str) -> dict[str, str]:
    """This environment with DIR first on PYTHONPATH and this repo off it."""
    here = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.realpath(p) != here]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, *rest])}


def serve_flags(root: str, module: str) -> frozenset[str]:
    """The option strings of the tree's `serve --help`: argparse lists them at the start of a line, two spaces in."""
    help_text = subprocess.run([sys.executable, "-m", module, "serve", "--help"], cwd=root, env=tree_env(root),
                               capture_output=True, text=True, check=True).stdout
    flags = set()
    for line in help_text.splitlines():
        if line.startswith("  -"):
            flags.update(re.findall(r"(?<![\w-])-{1,2}[a-zA-Z][\w-]*", line.strip().split("  ")[0]))
    return frozenset(flags)


def proto_blocks(path: str) -> dict[str, dict[int, tuple]]:
    """Per message: field number -> (name, type, repeated); per enum: value number -> (name,), from .proto text."""
    with open(path) as f:
        text = re.sub(r"\{\s*\}", "{\n}", re.sub(r"//[^\n]*", "", f.read()))  # an empty message's {} on two lines
    blocks = {}
    for kind, name, body in _BLOCK.findall(text):
        if kind == "message":
            blocks[name] = {int(n): (field, typ.rsplit(".", 1)[-1], label.strip() == "repeated")
                            for label, typ, field, n in _FIELD.findall(body)}
        else:
            blocks[name] = {int(n): (value,) for value, n in _ENUM_VALUE.findall(body)}
    return blocks


def _current_blocks(module) -> dict[str, dict[int, tuple]]:
    def type_name(f) -> str:
        if f.message_type is not None:
            return f.message_type.name
        if f.enum_type is not None:
            return f.enum_type.name
        return descriptor_pb2.FieldDescriptorProto.Type.Name(f.type)[len("TYPE_"):].lower()

    d = module.DESCRIPTOR
    blocks = {name: {f.number: (f.name, type_name(f), f.is_repeated) for f in m.fields}
              for name, m in d.message_types_by_name.items()}
    blocks.update({name: {v.number: (v.name,) for v in e.values} for name, e in d.enum_types_by_name.items()})
    return blocks


PROTOS = {"engine.proto": engine_pb2, "generation.proto": generation_pb2}


def check_protos(root: str) -> dict[str, dict[str, dict[int, tuple]]]:
    """Per .proto file, the tree's messages and enums (as proto_blocks gives them), once none clashes with ours."""
    theirs, clashes = {}, []
    for filename, module in PROTOS.items():
        old, new = proto_blocks(os.path.join(root, "protos", filename)), _current_blocks(module)
        theirs[filename] = old
        for block, fields in old.items():
            for number, field in fields.items():
                if block in new and number in new[block] and new[block][number] != field:
                    clashes.append(f"{filename} {block} {number}: {field} there, {new[block][number]} here")
    if clashes:
        raise SystemExit("--server-tree: its protos clash with this tree's stubs:\n  " + "\n  ".join(clashes))
    return theirs


def lacking_counters(theirs: dict[str, dict[str, dict[int, tuple]]], counters: tuple[str, ...]) -> tuple[str, ...]:
    """Of counters, those that SchedulerStats or Stats has here and not in the tree (they would read 0)."""
    lacking = []
    for filename, message in (("engine.proto", engine_pb2.SchedulerStats), ("generation.proto", generation_pb2.Stats)):
        names = {field[0] for field in theirs[filename].get(message.DESCRIPTOR.name, {}).values()}
        lacking += [c for c in counters if c in message.DESCRIPTOR.fields_by_name and c not in names]
    return tuple(dict.fromkeys(lacking))


def open_tree(root: str, counters: tuple[str, ...]) -> ServerTree:
    root = os.path.abspath(root)
    module = cli_module(root)
    theirs = check_protos(root)
    return ServerTree(root, module, serve_flags(root, module), lacking_counters(theirs, counters))


def _is_default(name: str, value: str | None) -> bool:
    """Whether an EngineConfig flag (--x value, --x or --no-x) holds this tree's default."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    if value is None:  # a boolean flag
        name, value = (name[3:], False) if name.startswith("no_") and name[3:] in defaults else (name, True)
    if name not in defaults:
        return False
    default = defaults[name]
    if isinstance(default, bool) or isinstance(value, bool):
        return value is default
    try:
        return float(value) == float(default)
    except (TypeError, ValueError):
        return str(value) == str(default)


def adapt_argv(tree: ServerTree, argv: list[str]) -> tuple[list[str], list[str]]:
    """argv less the flags the tree lacks that hold this tree's default: (argv for it, the flags dropped).
    A flag it lacks set to anything else, or not an engine flag, stops the run."""
    out, dropped, i = [], [], 0
    while i < len(argv):
        flag, eq, inline = argv[i].partition("=")
        if eq:
            item, value = argv[i:i + 1], inline
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            item, value = argv[i:i + 2], argv[i + 1]
        else:
            item, value = argv[i:i + 1], None
        i += len(item)
        if flag in tree.serve_flags:
            out += item
        elif _is_default(flag.lstrip("-").replace("-", "_"), value):
            dropped.append(flag)
        else:
            raise SystemExit(f"--server-tree {tree.root}: its serve has no {flag} (asked: {' '.join(item)})")
    return out, dropped
