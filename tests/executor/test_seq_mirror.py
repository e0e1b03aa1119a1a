"""The executor's sequence mirrors are plain Python and numpy: a tool that replays plans (such as
bench/scheduler_overhead.py) imports them without torch."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_sequence_mirrors_never_imports_torch():
    probe = ("import sys; import executor_svc.seq_mirror; "
             "leaked = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
             "sys.exit(f'torch imported: {leaked[:3]}' if leaked else 0)")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
