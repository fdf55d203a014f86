"""One kernel build per machine and CPU kind: whatever the checkout, the virtualenv or the cache
home of a process, a finished build is imported without compiling; a build killed mid-way does
not block the next; and a build that fails makes CI fail rather than skip the kernel tests."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tokenfleet.engines.native.kernels import build as kernel_build

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("kernels")]
ROOT = Path(kernel_build.__file__).resolve().parents[4]  # the checkout
LOAD = "import tokenfleet.engines.native.kernels.loader as k\nprint(k.__file__, k.load_kernels())"


def built_library() -> Path:
    found = kernel_build.find_build()
    assert found is not None, "the kernels fixture built them"
    return found / f"{kernel_build.NAME}.so"


def copy_package(into: Path) -> None:
    shutil.copytree(ROOT / "tokenfleet", into / "tokenfleet", ignore=shutil.ignore_patterns("__pycache__"))


def test_a_second_checkout_reuses_the_build(tmp_path):
    """The build is keyed by what changes the binary, not by where the sources lie."""
    built = built_library()
    before = built.stat().st_mtime_ns
    copy_package(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", LOAD], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert str(tmp_path) in done.stdout and kernel_build.NAME in done.stdout, done.stderr[-2000:]
    assert built.stat().st_mtime_ns == before, "the second checkout rebuilt the kernels"


def test_a_second_virtualenv_and_cache_home_load_the_build_without_compiling(tmp_path):
    """Another virtualenv (another sys.prefix, its packages reached through a .pth) with a cache
    home of its own (as the demo's test and many CI set-ups have) imports this machine's build:
    nothing is compiled, nothing is built under its cache home."""
    built = built_library()
    before = built.stat().st_mtime_ns
    venv = tmp_path / "venv2"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    (site / "main-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = "import logging, sys; logging.basicConfig(level=logging.INFO)\n" + LOAD + "\nprint(sys.prefix)"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache2")}
    env.pop("TOKENFLEET_KERNEL_CACHE", None)
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert kernel_build.NAME in done.stdout and str(venv) in done.stdout, done.stderr[-2000:]
    assert "loading the CPU kernels (built on this machine before" in done.stderr, done.stderr[-2000:]
    assert "building" not in done.stderr
    assert built.stat().st_mtime_ns == before, "the second virtualenv rebuilt the kernels"
    assert not list((tmp_path / "cache2").rglob("*.so"))


def test_a_process_waits_for_another_builder_then_imports_its_build(tmp_path):
    """A build in progress elsewhere (our OS lock held, no mark of a finished build yet, and a lock
    file of torch's that a killed build would leave): a starting process waits, saying so, and
    once the builder finishes imports its library, compiling nothing itself."""
    import fcntl
    import time

    cache = tmp_path / "kernels"
    build = cache / kernel_build.build_key()
    shutil.copytree(built_library().parent, build, ignore=shutil.ignore_patterns(kernel_build.DONE, "*.lock"))
    (build / "lock").write_text("")
    env = {**os.environ, "TOKENFLEET_KERNEL_CACHE": str(cache)}
    code = "import logging; logging.basicConfig(level=logging.INFO)\n" + LOAD
    with open(build / ".tokenfleet-build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # "another builder"
        waiter = subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        seen = []  # its log up to the line saying it waits: the build finishes only after that
        deadline = time.monotonic() + 120  # importing torch on a busy machine takes a while
        while not any("another process is building the CPU kernels here" in line for line in seen):
            line = waiter.stderr.readline()
            assert line and time.monotonic() < deadline, "it did not wait for the builder: " + "".join(seen)
            seen.append(line)
        assert waiter.poll() is None, "it did not wait for the builder"
        (build / kernel_build.DONE).write_text(json.dumps({"seconds": 1.0}))
        fcntl.flock(held, fcntl.LOCK_UN)
    out, rest = waiter.communicate(timeout=120)
    err = "".join(seen) + rest
    assert kernel_build.NAME in out, err[-2000:]
    assert "built the CPU kernels" not in err and "building the CPU kernels:" not in err, err[-2000:]
    assert not (build / "lock").exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ci", [True, False])
def test_a_broken_build_fails_the_kernel_tests_under_ci_and_skips_them_elsewhere(tmp_path, ci):
    """The C++ sources deliberately broken: under CI the kernel tests fail (CI must provide the
    kernels), on a developer's machine without a compiler they are skipped, saying why."""
    copy_package(tmp_path)
    for source in (tmp_path / "tokenfleet" / "engines" / "native" / "kernels" / "csrc").glob("*.cpp"):
        source.write_text("#error deliberately broken by a test\n")  # fails at once, no headers parsed
    (tmp_path / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    (tmp_path / "tests" / "test_needs_kernels.py").write_text("def test_it(kernels):\n    pass\n")
    env = {**os.environ, "TOKENFLEET_KERNEL_CACHE": str(tmp_path / "kernels"), "CI": "true" if ci else ""}
    env.pop("TOKENFLEET_TEST_SUMMARY", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "tests"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    if ci:
        assert done.returncode == 1, done.stdout[-3000:]
        assert "the CPU kernels is missing, and CI must provide it" in done.stdout, done.stdout[-3000:]
    else:
        assert done.returncode == 0, done.stdout[-3000:]
        assert "1 skipped" in done.stdout and "did not build here" in done.stdout, done.stdout[-3000:]
