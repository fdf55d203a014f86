"""The layout's rules (docs/LAYOUT.md): who may import what, no import cycles, where the environment
is read, module size, and a step's results passed as values rather than left on objects."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "tokenfleet"
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
    assert sorted(set(readers)) == [
        "config/loading.py",
        "engines/vllm/core.py",
        "engines/vllm/embed.py",
        "worker/process/malloc.py",
    ]


def test_no_module_outgrows_a_screenful_or_three():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert max(sizes.values()) <= MAX_MODULE_LINES, max(sizes.items(), key=lambda kv: kv[1])


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports, at any level (a function's lazy import too: a cycle
    through one is still a cycle), except under ``if TYPE_CHECKING``."""
    name = module_name(path)
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + [node.module])
            found.update([base, *(f"{base}.{alias.name}" for alias in node.names)])
    return {m for m in found if m in modules and m != name}


def test_no_import_cycles_among_the_packages_modules():
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: imports_of(path, set(paths)) for name, path in paths.items()}
    cycles = []
    for start in graph:  # a depth-first search from every module for a path back to it
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join([*trail, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*trail, nxt]))
    assert not cycles, cycles[:5]


def test_no_last_step_results_are_left_on_the_runner_for_others_to_read():
    """A step's results travel as return values (the runner's ``prefill`` returns its logits and
    what it computed): no ``last_*`` attribute set on a runner and read by another module."""
    runners = [p for p in PACKAGE.rglob("*.py") if "runner" in p.stem]
    left = {
        str(p.relative_to(PACKAGE)): node.attr
        for p in runners
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("last_")
        and isinstance(node.ctx, ast.Store)
    }
    assert not left, left
    readers = {
        str(p.relative_to(PACKAGE)): node.attr
        for p in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("last_prefill")
        and isinstance(node.ctx, ast.Load)
    }
    assert not readers, readers


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


MAX_MODULES_PER_FOLDER = 12


def test_no_folder_holds_more_modules_than_a_reader_takes_in_at_once():
    """A folder of the package holds at most :data:`MAX_MODULES_PER_FOLDER` modules (its
    ``__init__`` aside): past that it wants rooms by job, as ``engines/native/`` has."""
    crowded = {}
    for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MAX_MODULES_PER_FOLDER:
            crowded[str(folder.relative_to(PACKAGE.parent))] = len(modules)
    assert not crowded, crowded


def config_defaults() -> dict[str, set[str]]:
    """Every config setting's default (as source text), by field name."""
    from tokenfleet.config import GatewayConfig, WorkerConfig
    from tokenfleet.config.settings import specs

    defaults: dict[str, set[str]] = {}
    for root in (WorkerConfig, GatewayConfig):
        for spec in specs(root):
            defaults.setdefault(spec.path[-1], set()).add(repr(spec.default))
    return defaults


def test_no_parameter_default_restates_a_config_default():
    """A default lives on its config field only: a function or constructor outside ``config/``
    whose parameter is named as a setting and defaults to that setting's default is a second copy
    that drifts (the runner once took ``max_batch_size=32``; ``None``, meaning "not given", is
    not a copy)."""
    defaults = config_defaults()
    copies = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "config":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            for arg, default in pairs:
                try:
                    value = ast.literal_eval(default)
                except ValueError:
                    continue  # not a literal: a name or a call, not a restated value
                if value is not None and repr(value) in defaults.get(arg.arg, ()):
                    copies.append(f"{path.relative_to(PACKAGE)}: {node.name}({arg.arg}={value!r})")
    assert not copies, copies
