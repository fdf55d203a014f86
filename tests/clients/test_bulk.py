"""Bulk jobs: `tokenfleet batch` with a progress bar, resumed after an interruption, and as an RQ job."""

import json
import os
import signal
import subprocess
import sys
import time

from tokenfleet.config import DynamicBatchingConfig

BATCHING = DynamicBatchingConfig(max_wait_ms=5, max_batch_size=16, max_seq_len=256, buckets=(16, 64))


def write_prompts(path, n):
    lines = [
        json.dumps(f"bulk prompt {i}") if i % 2 else json.dumps({"prompt": f"bulk {i}", "max_new_tokens": 3})
        for i in range(n)
    ]
    path.write_text("\n".join(lines) + "\n")


def tf(args, env, **kw):
    return subprocess.Popen([sys.executable, "-m", "tokenfleet", *args], env={**os.environ, **env}, **kw)


def test_batch_resumes_after_interruption_without_redoing(
    run_worker, redis_url, prefix, model_path, reference, tmp_path
):
    prompts, results = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    write_prompts(prompts, 200)
    env = {"REDIS_URL": redis_url, "TOKENFLEET_PREFIX": prefix}
    args = [
        "batch",
        str(prompts),
        "-o",
        str(results),
        "--model",
        str(model_path),
        "--max-new-tokens",
        "4",
        "--window",
        "8",
    ]
    with run_worker(BATCHING) as running:
        first = tf(args, env, stderr=subprocess.DEVNULL)
        while not results.exists() or len(results.read_text().splitlines()) < 40:
            time.sleep(0.02)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        partial = len(results.read_text().splitlines())
        assert partial < 200
        second = tf(args, env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        out, err = second.communicate(timeout=300)
        assert second.returncode == 0, err
        finished = running.worker.requests_finished
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(200))  # every line once, in input order
    assert "200/200" in err  # the progress bar
    assert "already in" in out and "done" in out
    assert finished == 200, f"{finished} requests served for 200 prompts: finished ones were redone"
    assert rows[1]["token_ids"] == reference.greedy(reference.ids("bulk prompt 1"), 4)
    assert rows[0]["token_ids"] == reference.greedy(reference.ids("bulk 0"), 3)  # per-line parameters win


def test_batch_as_rq_job_with_json_serializer(run_worker, redis_url, prefix, model_path, r, tmp_path):
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from tokenfleet.gateway.dashboard import jobs as dashboard_jobs
    from tokenfleet.protocol import Keys

    prompts, results = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    write_prompts(prompts, 20)
    env = {"REDIS_URL": redis_url, "TOKENFLEET_PREFIX": prefix}
    with run_worker(BATCHING):
        enq = tf(
            [
                "batch",
                str(prompts),
                "-o",
                str(results),
                "--model",
                str(model_path),
                "--max-new-tokens",
                "2",
                "--enqueue",
            ],
            env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = enq.communicate(timeout=120)
        assert enq.returncode == 0, err
        job_id = out.strip()
        try:
            worker = tf(
                ["rq-worker", "--burst"], env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            logs, _ = worker.communicate(timeout=300)
            assert worker.returncode == 0, logs
            job = Job.fetch(job_id, connection=r, serializer=JSONSerializer)
            assert job.get_status() == "finished", logs
            assert job.return_value() == {"total": 20, "skipped": 0, "done": 20, "failed": 0}
            assert (job.meta["total"], job.meta["written"]) == (20, 20)  # its progress, as it ran
            [row] = dashboard_jobs.listing(r, Keys(prefix))  # as the dashboard shows it
            assert (row["id"], row["status"], row["completed"], row["total"]) == (job_id, "finished", 20, 20)
        finally:
            Job.fetch(job_id, connection=r, serializer=JSONSerializer).delete()
    assert len(results.read_text().splitlines()) == 20


def test_a_bulk_job_asked_to_stop_submits_nothing_more_and_ends(redis_url, prefix, r, tmp_path):
    """The dashboard's cancel of a running bulk job (its key, looked up each second by the job):
    asked before the job's first submit, the job submits nothing and ends with what it wrote."""
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from tokenfleet.gateway.dashboard import jobs as dashboard_jobs
    from tokenfleet.producer.rq_jobs import enqueue_batch
    from tokenfleet.protocol import Keys

    prompts, results = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    write_prompts(prompts, 20)
    job_id = enqueue_batch(redis_url, prefix, None, str(prompts), str(results), {})
    r.set(Keys(prefix).bulk_cancel(job_id), 1)
    worker = tf(["rq-worker", "--burst"], {"REDIS_URL": redis_url, "TOKENFLEET_PREFIX": prefix}, text=True)
    assert worker.wait(120) == 0
    job = Job.fetch(job_id, connection=r, serializer=JSONSerializer)
    assert job.return_value() == {"total": 20, "skipped": 0, "done": 0, "failed": 0}
    assert not results.exists() or results.read_text() == ""
    assert not r.exists(Keys(prefix).request_stream("auto"))  # nothing was submitted
    [row] = dashboard_jobs.listing(r, Keys(prefix))
    assert (row["status"], row["cancellable"]) == ("finished", False)


def test_batch_takes_openai_batch_lines_and_writes_openais_output(
    run_worker, redis_url, prefix, model_path, tmp_path
):
    prompts, results = tmp_path / "openai.jsonl", tmp_path / "out.jsonl"
    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": f"openai line {i}", "max_tokens": 3, "temperature": 0},
        }
        for i in range(12)
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    env = {"REDIS_URL": redis_url, "TOKENFLEET_PREFIX": prefix}
    with run_worker(BATCHING):
        run = tf(
            ["batch", str(prompts), "-o", str(results), "--model", str(model_path)],
            env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [row["custom_id"] for row in rows] == [f"req-{i}" for i in range(12)]
    for row in rows:
        assert row["error"] is None and row["response"]["status_code"] == 200
        assert row["response"]["body"]["object"] == "text_completion"
        assert len(row["response"]["body"]["choices"][0]["token_ids"]) == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**lines[0], "url": "/v1/embeddings"}) + "\n")
    refused = subprocess.run(
        [sys.executable, "-m", "tokenfleet", "batch", str(bad), "-o", str(tmp_path / "x.jsonl")],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1 and f"{bad}:1:" in refused.stderr
