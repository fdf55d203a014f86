"""The worker arranges its own memory allocator: tcmalloc by re-executing itself once, or glibc tuned."""

import os
import subprocess
import sys

import pytest

from tokenfleet.worker.process import malloc

CHILD = """
import sys
from tokenfleet.worker.process import malloc
malloc.arrange(sys.argv[1], [sys.executable, __file__, *sys.argv[1:]])
print(malloc.tcmalloc_loaded(), malloc.describe(), sep="|")
"""

needs_tcmalloc = pytest.mark.skipif(malloc.find_tcmalloc() is None, reason="no tcmalloc on this machine")


def run(tmp_path, choice: str, **env: str) -> tuple[bool, str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", malloc.ARRANGED)}
    out = subprocess.run(
        [sys.executable, str(script), choice], env={**base, **env}, capture_output=True, text=True, check=True
    ).stdout.strip()
    loaded, line = out.split("|")
    return loaded == "True", line


@needs_tcmalloc
def test_auto_reexecutes_itself_once_onto_tcmalloc_and_says_so(tmp_path):
    loaded, line = run(tmp_path, "auto")
    assert loaded
    assert line.startswith("allocator: tcmalloc (") and "--allocator system" in line


def test_system_leaves_the_process_as_started(tmp_path):
    loaded, line = run(tmp_path, "system")
    assert not loaded
    assert line == "allocator: the system's (--allocator system)"


@needs_tcmalloc
def test_a_users_own_preload_is_kept(tmp_path):
    mine = malloc.find_tcmalloc()
    loaded, line = run(tmp_path, "auto", LD_PRELOAD=mine)
    assert loaded
    assert line == f"allocator: as preloaded by LD_PRELOAD ({mine})"


def test_without_tcmalloc_glibc_is_tuned_instead(tmp_path, monkeypatch):
    monkeypatch.setattr(malloc, "find_tcmalloc", lambda: None)
    monkeypatch.delenv(malloc.ARRANGED, raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    malloc.arrange("auto")  # no re-exec: it returns
    assert os.environ[malloc.ARRANGED] == "glibc"
    assert "glibc, thresholds raised" in malloc.describe()
    monkeypatch.delenv(malloc.ARRANGED)
    with pytest.raises(ValueError, match="no tcmalloc here"):
        malloc.arrange("tcmalloc")
