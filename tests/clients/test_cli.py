"""The command line as users run it: real processes, a real Redis, a real tiny model."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from conftest import worker_process

from tokenfleet.cli import main


def tf(*args, env=None, timeout=120, **kw):
    return subprocess.run(
        [sys.executable, "-m", "tokenfleet", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        **kw,
    )


@pytest.mark.parametrize(
    "command", [[], ["worker"], ["submit"], ["demo"], ["model", "init"], ["result"], ["cancel"]]
)
def test_help_explains_every_command(command):
    out = CliRunner().invoke(main, [*command, "--help"])
    assert out.exit_code == 0
    assert "Usage:" in out.output and len(out.output.splitlines()) > 3


def test_bad_flag_value_is_one_clear_line(tiny_model):
    out = CliRunner().invoke(main, ["worker", "--model", tiny_model, "--buckets", "64,x"])
    assert out.exit_code != 0
    assert "buckets must be comma-separated integers" in out.output
    assert "Traceback" not in out.output


def test_model_init_writes_a_from_pretrained_directory(tmp_path):
    out = CliRunner().invoke(main, ["model", "init", str(tmp_path / "m")])
    assert out.exit_code == 0, out.output
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(tmp_path / "m").model_type == "llama"
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert tok.decode(tok("héllo").input_ids, skip_special_tokens=True) == "héllo"


@pytest.mark.timeout(300)  # a minute or more on a busy 2-core machine
def test_demo_runs_end_to_end_and_forms_batches(redis_url, tmp_path, kernels):
    # a fresh cache home for the demo's model: the machine's kernel build is still found there
    out = tf(
        "demo",
        "--tiny",
        "--requests",
        "12",
        "--max-new-tokens",
        "8",
        env={"XDG_CACHE_HOME": str(tmp_path), "REDIS_URL": redis_url},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    sizes = [int(line.split()[-1]) for line in out.stdout.splitlines() if line.startswith("batch size")]
    assert sum(sizes) == 12 and max(sizes) > 1, out.stdout
    assert out.stdout.count("TTFT") == 12
    assert "building the tiny demo model" in out.stdout and "starting a worker" in out.stdout
    assert "building the CPU kernels" not in out.stdout + out.stderr


@pytest.mark.timeout(180)  # a minute or more on a busy 2-core machine
def test_worker_process_serves_cli_submit_and_exits_0_on_sigterm(redis_url, prefix, tiny_model):
    env = {"REDIS_URL": redis_url, "TOKENFLEET_PREFIX": prefix}
    worker = worker_process(
        tiny_model,
        redis_url,
        prefix,
        "--buckets",
        "32,64",
        "--max-wait-ms",
        "10",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out = tf("submit", "--model", tiny_model, "--max-new-tokens", "6", "--json", "Hello", env=env)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert len(result["token_ids"]) == 6 and result["finish_reason"] == "length"
        replay = tf("result", result["id"], env=env)
        assert json.loads(replay.stdout)["token_ids"] == result["token_ids"]
        from tokenfleet.producer import Client

        client = Client(redis_url, model=tiny_model, prefix=prefix)
        long = client.submit("go on and on", max_new_tokens=2000, ignore_eos=True)
        next(iter(long.stream(timeout=60)))
        assert tf("cancel", long.id, env=env).returncode == 0
        assert client.result(long.id, timeout=30).finish_reason == "cancelled"
    finally:
        time.sleep(0.2)
        worker.send_signal(signal.SIGTERM)
        logs, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0, logs[-2000:]
    assert "batch size 1" in logs
    assert "stopped after" in logs.splitlines()[-1], logs[-2000:]  # the last line: no exit noise


def test_submit_without_redis_fails_with_one_line():
    out = tf("submit", "--redis-url", "redis://127.0.0.1:1/0", "--timeout", "2", "hi")
    assert out.returncode != 0
    assert "Error:" in out.stderr and "Traceback" not in out.stderr


def dry_run(args, env=None):
    out = CliRunner().invoke(main, ["worker", "--dry-run", *args], env=env or {})
    assert out.exit_code == 0, out.output
    return json.loads(out.output)


def test_profiles_config_file_env_and_flags_layer_in_order(tiny_model, tmp_path):
    online = dry_run(["--model", tiny_model, "--profile", "online"])
    assert (online["max_wait_ms"], online["max_batch_size"], online["max_seq_len"]) == (50, 16, 4096)
    offline = dry_run(["--model", tiny_model, "--profile", "offline"])
    assert (offline["max_wait_ms"], offline["max_batch_size"], offline["max_seq_len"]) == (2000, 64, 8192)
    assert offline["max_prefill_tokens"] == 8192
    toml = tmp_path / "worker.toml"
    toml.write_text(
        f'[worker]\nmodel = "{tiny_model}"\nprofile = "offline"\nmax-batch-size = 48\n'
        f"buckets = [64, 128]\nmax_wait_ms = 700\n"
    )
    from_file = dry_run(["--config", str(toml)])
    assert from_file["model"] == tiny_model
    assert from_file["max_batch_size"] == 48  # file beats profile
    assert from_file["max_seq_len"] == 8192  # profile fills the rest
    assert from_file["buckets"] == [64, 128]
    env = dry_run(["--config", str(toml)], env={"TOKENFLEET_MAX_WAIT_MS": "20"})
    assert env["max_wait_ms"] == 20  # environment beats file
    flag = dry_run(["--config", str(toml), "--max-wait-ms", "5"], env={"TOKENFLEET_MAX_WAIT_MS": "20"})
    assert flag["max_wait_ms"] == 5  # command line beats everything
    assert flag["max_prefill_tokens"] == 8192  # the offline profile, from the file
    budget = dry_run(["--config", str(toml), "--max-prefill-tokens", "512"])
    assert budget["max_prefill_tokens"] == 512
    assert budget["overlap_io"] == "auto"
    toml.write_text(f'model = "{tiny_model}"\noverlap-io = "off"\n')
    assert dry_run(["--config", str(toml)])["overlap_io"] == "off"
    assert dry_run(["--model", tiny_model], env={"TOKENFLEET_OVERLAP_IO": "on"})["overlap_io"] == "on"
    assert dry_run(["--model", tiny_model, "--overlap-io", "off"])["overlap_io"] == "off"
    out = CliRunner().invoke(main, ["worker", "--model", tiny_model, "--overlap-io", "yes", "--dry-run"])
    assert out.exit_code != 0 and "auto" in out.output


def test_config_file_typos_and_missing_model_are_one_line_errors(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("max_wiat_ms = 10\n")
    out = CliRunner().invoke(main, ["worker", "--config", str(toml)])
    assert out.exit_code != 0 and "unknown settings" in out.output and "max_wiat_ms" in out.output
    out = CliRunner().invoke(main, ["worker"])
    assert out.exit_code != 0 and "no model" in out.output


# -- a user's first hour ---------------------------------------------------------------------------


def test_submit_names_its_request_and_says_when_nobody_serves(redis_url, prefix, model_path):
    env = {"REDIS_URL": redis_url, "TOKENFLEET_PREFIX": prefix}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenfleet", "submit", "--model", str(model_path), "--id", "lonely-1", "hi"],
        env={**os.environ, **env},
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [proc.stderr.readline() for _ in range(2)]
        assert lines[0].strip() == "request lonely-1"
        assert "no live worker serves" in lines[1] and repr(prefix) in lines[1] and "stays" in lines[1]
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the request is cancelled, and the user told
        _, rest = proc.communicate(timeout=120)  # generous: a loaded 2-core host is slow to exit
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "cancelled request lonely-1" in rest and "Traceback" not in rest
    import redis as redis_py

    assert redis_py.Redis.from_url(redis_url).exists(f"{prefix}:cancel:lonely-1")


def test_result_and_cancel_of_unknown_or_invalid_ids_fail_at_once(redis_url, prefix):
    env = {"REDIS_URL": redis_url, "TOKENFLEET_PREFIX": prefix}
    started = time.monotonic()
    unknown = tf("result", "never-was", "--timeout", "60", env=env)
    assert unknown.returncode == 1 and "no such request 'never-was'" in unknown.stderr
    assert time.monotonic() - started < 30, "it waited for the timeout"
    assert "no such request" in tf("cancel", "never-was", env=env).stderr
    invalid = tf("cancel", "not valid!", env=env)
    assert invalid.returncode == 1 and "is not a request id" in invalid.stderr


def test_commands_fail_in_one_line_without_redis(tmp_path):
    (tmp_path / "p.jsonl").write_text('"hi"\n')
    env = {"REDIS_URL": "redis://127.0.0.1:1/0"}
    for args in (
        ["result", "x"],
        ["batch", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "o")],
        ["rq-worker"],
    ):
        out = tf(*args, env=env, timeout=60)
        assert out.returncode == 1, args
        assert "Traceback" not in out.stderr and "Connection" in out.stderr, (args, out.stderr)


def test_batch_checks_every_line_before_submitting_anything(redis_url, prefix, model_path, tmp_path, r):
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('"fine"\n{"prompt": "also fine"}\n{"prompt": 42}\n')
    out = tf(
        "batch", str(prompts), "-o", str(tmp_path / "out.jsonl"), "--model", str(model_path),
        env={"REDIS_URL": redis_url, "TOKENFLEET_PREFIX": prefix},
    )  # fmt: skip
    assert out.returncode == 1 and f"{prompts}:3: prompt must be a string" in out.stderr
    assert "Traceback" not in out.stderr
    assert not list(r.scan_iter(match=f"{{{prefix}}}:req:*")), "something was submitted"


def test_batch_exits_non_zero_when_a_request_failed(run_worker, redis_url, prefix, model_path, tmp_path):
    from tokenfleet.config import DynamicBatchingConfig

    prompts = tmp_path / "in.jsonl"
    prompts.write_text('"fine"\n{"prompt": "too much", "max_new_tokens": 60000}\n')
    with run_worker(DynamicBatchingConfig(max_wait_ms=5, max_batch_size=4, max_seq_len=256, buckets=(64,))):
        out = tf(
            "batch", str(prompts), "-o", str(tmp_path / "out.jsonl"), "--model", str(model_path),
            env={"REDIS_URL": redis_url, "TOKENFLEET_PREFIX": prefix},
        )  # fmt: skip
    assert out.returncode == 1 and "1 done, 1 failed" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert "error" in rows[1] and "text" in rows[0]


def test_model_init_keeps_what_is_there_unless_forced(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "mine.txt").write_text("keep")
    out = CliRunner().invoke(main, ["model", "init", str(target)])
    assert out.exit_code == 1 and "--force" in out.output
    assert CliRunner().invoke(main, ["model", "init", str(target), "--force"]).exit_code == 0


def test_top_level_help_shows_whole_summaries():
    out = CliRunner().invoke(main, ["--help"])
    commands = out.output.split("Commands:")[1]
    assert "..." not in commands and "…" not in commands


def test_worker_on_a_directory_that_is_not_a_model_says_so(tmp_path):
    out = CliRunner().invoke(main, ["worker", "--model", str(tmp_path)])
    assert out.exit_code == 1 and "is not a Hugging Face model directory" in out.output
    assert "tokenizer" in out.output and "Traceback" not in out.output


def test_submit_with_a_schema_or_regex_and_logprobs(run_worker, redis_url, prefix, model_path, tmp_path):
    import re

    from tokenfleet.config import DynamicBatchingConfig

    schema = tmp_path / "schema.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["n"],
                "additionalProperties": False,
            }
        )
    )
    env = {"REDIS_URL": redis_url, "TOKENFLEET_PREFIX": prefix}
    with run_worker(DynamicBatchingConfig(max_wait_ms=5, max_batch_size=4, max_seq_len=256, buckets=(64,))):
        by_regex = tf(
            "submit",
            "--model",
            str(model_path),
            "--regex",
            "[0-9]{3}",
            "--logprobs",
            "2",
            "--json",
            "hi",
            env=env,
        )
        by_schema = tf(
            "submit",
            "--model",
            str(model_path),
            "--json-schema",
            str(schema),
            "--max-new-tokens",
            "32",
            "hi",
            env=env,
        )
        both = tf("submit", "--json-schema", str(schema), "--regex", "x", "hi", env=env)
    assert by_regex.returncode == 0, by_regex.stderr
    result = json.loads(by_regex.stdout)
    assert re.fullmatch("[0-9]{3}", result["text"]) and result["finish_reason"] == "stop"
    assert len(result["logprobs"]) == len(result["token_ids"])
    assert all(len(lp["top"]) <= 2 and lp["logprob"] <= 0 for lp in result["logprobs"])
    assert by_schema.returncode == 0, by_schema.stderr
    assert 0 <= json.loads(by_schema.stdout)["n"] <= 99
    assert both.returncode != 0 and "not both" in both.stderr
