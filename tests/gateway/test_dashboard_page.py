"""The dashboard driven in a real headless browser (Debian's Chromium through Playwright) against a
real gateway, real workers and a real Redis: what an operator sees and does."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import httpx
import pytest
import redis
from conftest import missing, worker_process

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.errors import RequestFailed
from tokenfleet.gateway.dashboard.routes import assets_digest
from tokenfleet.producer import Client
from tokenfleet.protocol import GROUP, ErrorCode, Keys

pytestmark = pytest.mark.integration

ADMIN, VIEWER = "admin-key-for-tests", "viewer-key-for-tests"
BATCHING = DynamicBatchingConfig(max_wait_ms=10, max_batch_size=8, max_seq_len=256, buckets=(16, 32, 64))
WAIT_MS = 60_000  # longest the page may take to show what the fleet did (a worker's start included)
# TOKENFLEET_SCREENSHOTS=docs/images: the tests' screenshots replace the docs' (see docs/images/README.md)
SHOTS = os.environ.get("TOKENFLEET_SCREENSHOTS")


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        missing("Chromium", "install Debian's chromium (apt-get install chromium) for the dashboard's tests")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("Playwright", "pip install playwright (tokenfleet[dev])")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield launched
        launched.close()


def open_page(browser, url: str, key: str = ADMIN):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(f"{url}/dashboard#key={key}")
    page.wait_for_selector("#app:not([hidden])")
    return page


def show(page, tab: str) -> None:
    page.click(f"#tabs button[data-tab={tab}]")


def screenshot(page, name: str) -> None:
    """Replace the docs' screenshot ``name`` (with TOKENFLEET_SCREENSHOTS), and note which page
    version it shows (tests/project checks that the docs show the current one)."""
    if SHOTS:
        page.screenshot(path=str(Path(SHOTS) / f"dashboard-{name}.png"), full_page=True)
        (Path(SHOTS) / "dashboard-version.txt").write_text(assets_digest() + "\n")


def test_the_page_shows_a_queue_fill_and_drain_a_worker_start_and_go_stale_and_a_request_live(
    browser, gateways, redis_url, prefix, model_path, kernels
):
    from playwright.sync_api import expect

    gateway = gateways("--admin-keys", ADMIN, "--viewer-keys", VIEWER)
    page = open_page(browser, gateway.url)
    with Client(redis_url, model=str(model_path), prefix=prefix) as client:
        handles = [client.submit(f"queued line {i}", max_new_tokens=24) for i in range(6)]
        # no worker yet: the queue fills (no bucket is served, so they wait on the auto stream)
        waiting = page.locator('#queues tr[data-queue="auto"] td.waiting')
        expect(waiting).to_have_text("6", timeout=WAIT_MS)
        screenshot(page, "queue")

        show(page, "requests")  # looked up while queued, then followed live
        page.fill("#request-id", handles[-1].id)
        page.click("#lookup-form button")
        expect(page.locator("#request-state")).to_have_text("queued", timeout=WAIT_MS)

        worker = worker_process(str(model_path), redis_url, prefix, "--buckets", "16,32,64")
        try:
            expect(page.locator("#request-state")).to_have_text("done", timeout=WAIT_MS)
            result = client.result(handles[-1].id, timeout=60)
            assert page.locator("#request-text").text_content() == result.text
            assert page.locator("#request-worker").text_content() == result.worker
            screenshot(page, "request")

            show(page, "overview")
            row = page.locator(f'#workers tr[data-worker="{result.worker}"]')
            expect(row.locator("td.state")).to_have_text("alive", timeout=WAIT_MS)
            for handle in handles:
                client.result(handle.id, timeout=60)
            expect(page.locator("#queues tr.busy")).to_have_count(0, timeout=WAIT_MS)  # drained
            expect(page.locator("#now-ttft")).not_to_be_empty(timeout=WAIT_MS)  # the charts' series
            screenshot(page, "overview")
        finally:
            worker.send_signal(signal.SIGKILL)
            worker.wait(30)
        expect(row.locator("td.state")).to_have_text("stale", timeout=WAIT_MS)
        expect(row).to_have_class("stale")
    page.close()


def test_an_admin_requeues_and_deletes_dead_letters_and_cancels_a_batch_a_viewer_cannot(
    browser, gateways, redis_url, prefix, model_path, run_worker, r
):
    from playwright.sync_api import expect

    gateway = gateways("--admin-keys", ADMIN, "--viewer-keys", VIEWER)
    keys = Keys(prefix)
    openai_client = gateway.openai()
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": "x"},
        }
        for i in range(20)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = openai_client.files.create(file=("in.jsonl", data), purpose="batch")
    batch = openai_client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    )
    page = open_page(browser, gateway.url)
    page.on("dialog", lambda dialog: dialog.accept())
    show(page, "jobs")
    job = page.locator(f'#jobs tr[data-job="{batch.id}"]')
    expect(job.locator("td.status")).to_have_text("in_progress", timeout=WAIT_MS)  # no worker yet
    job.locator("button", has_text="Cancel").click()
    expect(job.locator("td.status")).to_have_text("cancelling", timeout=WAIT_MS)

    with Client(redis_url, model=str(model_path), prefix=prefix) as client:
        # a request whose worker took it and died (its entry pending under a consumer that is gone)
        poisoned = client.submit("served after all", max_new_tokens=8, request_id="poisoned-1")
        r.xgroup_create(keys.auto_stream, GROUP, id="0", mkstream=True)
        r.xreadgroup(GROUP, "a-worker-that-died", {keys.auto_stream: ">"}, count=1)
        r.xadd(keys.auto_stream, {"m": b"\xc1 not msgpack"})  # an entry nobody can decode
        with run_worker(BATCHING, max_attempts=1, claim_idle_ms=200, served_model_name="tiny") as worker:
            with pytest.raises(RequestFailed) as failed:
                client.result(poisoned.id, timeout=60)
            assert failed.value.code == ErrorCode.TOO_MANY_ATTEMPTS

            show(page, "dead")
            rows = page.locator("#dead tbody tr")
            expect(rows).to_have_count(2, timeout=WAIT_MS)
            screenshot(page, "dead-letters")
            page.locator('#dead tr[data-request="poisoned-1"] button', has_text="Requeue").click()
            expect(rows).to_have_count(1, timeout=WAIT_MS)
            served = client.result(poisoned.id, timeout=60)  # the same id, run again
            assert served.finish_reason in ("length", "stop") and served.usage["completion_tokens"] > 0
            undecodable = rows.first  # requeued it would only fail again: the page does not offer it
            expect(undecodable.locator("button", has_text="Requeue")).to_be_disabled()
            undecodable.locator("button", has_text="Delete").click()
            expect(rows).to_have_count(0, timeout=WAIT_MS)

            show(page, "jobs")
            expect(job.locator("td.status")).to_have_text("cancelled", timeout=WAIT_MS)
            worker.assert_healthy()

    show(page, "audit")
    actions = page.locator("#audit tbody tr")
    expect(actions).to_have_count(3, timeout=WAIT_MS)
    assert [actions.nth(k).locator("td").nth(2).text_content() for k in range(3)] == [
        "delete",
        "requeue",
        "cancel",
    ]
    page.close()

    viewer = open_page(browser, gateway.url, VIEWER)
    show(viewer, "dead")
    expect(viewer.locator("#requeue-all")).to_be_hidden()
    viewer.close()
    refused = httpx.post(
        f"{gateway.url}/dashboard/api/dead-all/delete", headers={"Authorization": f"Bearer {VIEWER}"}
    )
    assert refused.status_code == 403
    assert httpx.get(f"{gateway.url}/dashboard/api/overview").status_code == 401
    assert httpx.get(f"{gateway.url}/dashboard").status_code == 200  # the page itself holds no data
    assert r.xlen(keys.audit) == 3  # refusals before the key check are not actions


def test_bulk_jobs_show_their_progress_and_cancel_before_they_start(redis_url, prefix, tmp_path):
    from tokenfleet.gateway.dashboard import jobs
    from tokenfleet.producer.rq_jobs import enqueue_batch

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(f"line {i}") + "\n" for i in range(5)))
    client = redis.Redis.from_url(redis_url)
    job_id = enqueue_batch(redis_url, prefix, None, str(prompts), str(tmp_path / "out.jsonl"), {})
    keys = Keys(prefix)
    [row] = jobs.listing(client, keys)
    assert (row["id"], row["kind"], row["status"], row["cancellable"]) == (job_id, "bulk", "queued", True)
    assert row["input"] == str(prompts)
    assert jobs.cancel(client, keys, job_id) == {"cancelled": job_id, "status": "canceled"}
    [row] = jobs.listing(client, keys)
    assert (row["status"], row["cancellable"]) == ("canceled", False)
    with pytest.raises(jobs.Refused):
        jobs.cancel(client, keys, job_id)
    client.close()
