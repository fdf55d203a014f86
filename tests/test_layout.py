"""The layout's rules (DESIGN.md): who may import what, where the environment is read, module size."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tokenfleet"
MAX_MODULE_LINES = 300


def test_the_client_side_and_the_transport_import_no_torch():
    code = (
        "import sys\n"
        "import tokenfleet.producer, tokenfleet.transport.round_trip, tokenfleet.transport.registry\n"
        "import tokenfleet.protocol, tokenfleet.config, tokenfleet.batcher, tokenfleet.kvcache.allocator\n"
        "import tokenfleet.cli\n"
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
    # vLLM's own switch is set (not read) for the engine it starts in this process
    assert sorted(set(readers)) == ["config/loading.py", "engines/vllm/core.py"]


def test_no_module_outgrows_a_screenful_or_three():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert max(sizes.values()) <= MAX_MODULE_LINES, max(sizes.items(), key=lambda kv: kv[1])
