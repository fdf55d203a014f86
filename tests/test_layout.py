"""The layout's rules (DESIGN.md): who may import what, where the environment is read, module size."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tokenfleet"
MAX_MODULE_LINES = 300


def test_the_client_side_and_the_transport_import_no_torch():
    code = (
        "import sys\n"
        "import tokenfleet.producer, tokenfleet.transport.round_trip, tokenfleet.transport.registry\n"
        "import tokenfleet.protocol, tokenfleet.config, tokenfleet.batcher, tokenfleet.kvcache.allocator\n"
        "import tokenfleet.cli, tokenfleet.gateway.app\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_the_environment_is_read_in_config_loading_only():
    readers = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                readers.append(str(path.relative_to(PACKAGE)))
    # vLLM's own switch is set (not read) for the engine it starts in this process; the worker's
    # allocator builds the environment (LD_PRELOAD) of the process it re-executes as
    assert sorted(set(readers)) == ["config/loading.py", "engines/vllm/core.py", "worker/allocator.py"]


def test_no_module_outgrows_a_screenful_or_three():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert max(sizes.values()) <= MAX_MODULE_LINES, max(sizes.items(), key=lambda kv: kv[1])


@pytest.mark.integration  # downloads the client's packages from the registry
@pytest.mark.timeout(900)
def test_pip_install_without_extras_gives_the_client_and_gateway_without_torch(tmp_path):
    """The light install, for real: a fresh virtualenv, `pip install <this checkout>`, then the
    client, the CLI and the gateway import with no torch anywhere."""
    import time

    venv = tmp_path / "light"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    started = time.monotonic()
    install = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--quiet", str(PACKAGE.parent)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    code = (
        "import importlib.util, pathlib, sys\n"
        "import tokenfleet.producer, tokenfleet.gateway.app, tokenfleet.cli\n"
        "assert importlib.util.find_spec('torch') is None, 'torch is installed'\n"
        "files = (f for f in pathlib.Path(sys.prefix).rglob('*') if f.is_file())\n"
        "print(round(sum(f.stat().st_size for f in files) / 2**20))\n"
    )
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    print(f"light install: {time.monotonic() - started:.0f} s, {out.stdout.strip()} MiB")
    refused = subprocess.run(
        [str(venv / "bin" / "tokenfleet"), "worker", "--model", str(tmp_path)], capture_output=True, text=True
    )
    assert refused.returncode != 0 and "pip install 'tokenfleet[worker]'" in refused.stderr
