"""The repository speaks of the product: no measurement or decision is named after a working "session"
(a reader cannot know what one was or when it happened). A measurement is named by its date and commit
("2026-12-02, e3fc8a5"). The word stays free for what it means in the product: a process session (setsid),
an HTTP/2 or gRPC session, a pytest fixture's scope."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A session as a unit of time or authorship: numbered (the word, then a number, with a space, a hyphen or
# none) or pointed at (the word after this, that, earlier, previous, next, last, same, current); the test
# below spells out the examples.
SESSION_AS_TIME = re.compile(
    r"\bsessions? ?\d+|\bsession-\d|\b(?:this|that|earlier|previous|next|last|same|current) sessions?\b",
    re.IGNORECASE)


def tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout (or git is missing): the tracked files are unknown")
    files = []
    for name in out.stdout.decode().split("\0"):
        path = REPO / name
        if name and path.is_file():
            files.append(path)
    if not files:
        pytest.skip("git lists no tracked files here")
    return files


def session_mentions(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each line that names a session as time or authorship."""
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if SESSION_AS_TIME.search(line)]


def test_the_pattern_catches_a_session_used_as_time_and_spares_the_product_meanings():
    word = "sess" + "ion"  # spelt apart so that this file does not match itself
    for line in (f"measured in {word} 13", f"{word.capitalize()}s 1 and 2", f"the {word}-4 tree",
                 f"before this {word}'s changes", f"for the next {word}'s first call", f"(same {word})"):
        assert session_mentions(line), line
    for line in ('@pytest.fixture(scope="session")', "os.setsid() starts a new session", "an HTTP/2 session",
                 f"a {word}-cached checkpoint", "grpc session state"):
        assert not session_mentions(line), line


def test_no_tracked_text_names_a_session_as_a_unit_of_time_or_authorship():
    found = []
    for path in tracked_text_files():
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (a figure, a wheel)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{path.relative_to(REPO)}:{n}: {line}" for n, line in session_mentions(text)]
    assert not found, ("name these by date and commit ('2026-12-02, e3fc8a5'), by what was measured, or drop "
                       "them:\n" + "\n".join(found))
