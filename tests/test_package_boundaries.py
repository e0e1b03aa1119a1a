"""The boundaries between the packages (DESIGN.md, "Where each concept lives"):

- invariant 3: the control plane never imports torch, not even transitively;
- the executor imports nothing of the control plane but scheduler_svc.common (and protos);
- no import cycle within a package.
"""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib, pkgutil, sys
import scheduler_svc
names = [m.name for m in pkgutil.walk_packages(scheduler_svc.__path__, "scheduler_svc.")
         if m.name.rsplit(".", 1)[-1] != "__main__"]  # __main__ would run the CLI
for name in names:
    importlib.import_module(name)
assert "scheduler_svc.core.scheduler" in names, names
assert "llguidance" in sys.modules  # structured output's grammar engine is part of the control plane
leaked = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(len(names), "modules;", "torch imported" if leaked else "no torch")
sys.exit(1 if leaked else 0)
"""

TORCH_FREE_PACKAGES = ("scheduler_svc.core", "scheduler_svc.frontend", "scheduler_svc.text",
                       "scheduler_svc.entrypoints", "scheduler_svc.common")


def _no_torch_after(code: str) -> subprocess.CompletedProcess:
    probe = f"{code}\nimport sys\nsys.exit(1 if 'torch' in sys.modules else 0)"
    return subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_importing_every_scheduler_svc_module_never_imports_torch():
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no torch" in result.stdout


def test_the_control_plane_packages_import_without_torch():
    result = _no_torch_after("import " + ", ".join(TORCH_FREE_PACKAGES))
    assert result.returncode == 0, result.stderr


def test_structured_output_compiles_a_grammar_and_fills_a_token_mask_without_torch(embedded_model):
    result = _no_torch_after(f"""
import time
from protos import engine_pb2
from scheduler_svc.core.sequence import Sequence
from scheduler_svc.core.scheduler_output import ScheduledSeq
from scheduler_svc.core.structured.compiler import GrammarCompiler, tokenizer_loader
from scheduler_svc.core.structured.structured_outputs import StructuredOutputs
structured = StructuredOutputs(GrammarCompiler(tokenizer_loader({embedded_model!r}, 49152, (2,))), 49152)
seq = Sequence(seq_id=1, request_id="r", token_ids=[5], num_prompt_tokens=1, sampling=engine_pb2.SamplingOptions(),
               stopping=engine_pb2.StoppingOptions(), constraint=engine_pb2.Constraint(json_object=True))
structured.add(seq)
deadline = time.monotonic() + 60
while not structured.is_ready(seq):
    assert not structured.poll() and time.monotonic() < deadline
    time.sleep(0.01)
masks, _ = structured.plan_masks([ScheduledSeq(seq, 1, True, 0, True)])
assert list(masks.seq_ids) == [1] and len(masks.words) == 49152 // 8
""")
    assert result.returncode == 0, result.stderr


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth of the file (lazy imports count too)."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the file's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


def _sources(*packages: str) -> list[Path]:
    return [p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))]


def test_the_executor_and_kernels_import_only_the_common_part_of_the_control_plane():
    offending = {}
    for path in _sources("executor_svc", "kernels"):
        bad = sorted(m for m in _imports(path)
                     if m.startswith("scheduler_svc") and not m.startswith("scheduler_svc.common"))
        if bad:
            offending[str(path.relative_to(ROOT))] = bad
    assert not offending, offending


def _cycle_within_packages() -> list[str] | None:
    """A cycle among the imports between modules of one package (folder), if any."""
    modules = {_module_name(p): p for p in _sources("scheduler_svc", "executor_svc", "kernels", "protos")}
    graph = {}
    for name, path in modules.items():
        folder = name.rpartition(".")[0] if path.name != "__init__.py" else name
        graph[name] = {m for m in _imports(path) if m in modules and m != name
                       and m.rpartition(".")[0] == folder and modules[m].name != "__init__.py"}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [node])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def test_no_import_cycle_within_a_package():
    assert _cycle_within_packages() is None


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch):
    """The check above can fail: two modules of one package importing each other are caught."""
    pkg = tmp_path / "scheduler_svc" / "core"
    pkg.mkdir(parents=True)
    for name in ("scheduler_svc", "executor_svc", "kernels", "protos"):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from scheduler_svc.core import b\n")
    (pkg / "b.py").write_text("def f():\n    from scheduler_svc.core.a import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    cycle = _cycle_within_packages()
    assert cycle is not None and set(cycle) == {"scheduler_svc.core.a", "scheduler_svc.core.b"}


# The CPU image installs the CPU torch wheel, which brings no Triton: an executor there imports every module of its
# step path without it (kernels that need Triton are imported where they run, or fall back to torch)
NO_TRITON_PROBE = """
import importlib.abc, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, NoTriton())
import executor_svc.executor, executor_svc.model_runner, executor_svc.speculative_verify, executor_svc.draft_model
assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules)
"""


def test_the_executor_imports_its_step_path_without_triton():
    result = subprocess.run([sys.executable, "-c", NO_TRITON_PROBE], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
