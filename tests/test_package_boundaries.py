"""Invariant 3: the control plane never imports torch, not even transitively."""
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
leaked = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(len(names), "modules;", "torch imported" if leaked else "no torch")
sys.exit(1 if leaked else 0)
"""


def test_importing_every_scheduler_svc_module_never_imports_torch():
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no torch" in result.stdout
