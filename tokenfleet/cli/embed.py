"""``tokenfleet embed``: a JSONL file of texts through an embedding fleet, vectors in input order."""

from __future__ import annotations

from typing import Any

import click

from tokenfleet.cli.common import (
    check_tokenizer_dir,
    model_dir_option,
    one_line_errors,
    prefix_option,
    redis_url_option,
)
from tokenfleet.config import prefix_from_env, redis_url_from_env
from tokenfleet.protocol import LANES


@click.command(short_help="Embed a JSONL file of texts; vectors in order.")
@click.argument("input_path", metavar="TEXTS.jsonl", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "-o",
    "--output",
    "output_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="Vectors JSONL, one line per input line, in input order.",
)
@redis_url_option
@prefix_option
@model_dir_option
@click.option(
    "--dimensions", type=click.IntRange(min=1), default=None, help="Keep the first N, normalised again."
)
@click.option(
    "--normalize/--no-normalize", default=None, help="Unit length (default: as the model's config says)."
)
@click.option(
    "--truncate/--no-truncate",
    default=True,
    show_default=True,
    help="Cut texts longer than the model takes, as sentence-transformers does (else they fail).",
)
@click.option("--base64", "base64_vectors", is_flag=True, help="Write vectors as base64 of float32 bytes.")
@click.option("--window", type=int, default=256, show_default=True, help="Texts in flight at once.")
@click.option(
    "--priority",
    type=click.Choice(LANES),
    default=LANES[1],
    show_default=True,
    help="Priority lane: batch queues behind interactive traffic.",
)
def embed(
    input_path: str,
    output_path: str,
    redis_url: str | None,
    prefix: str | None,
    model_dir: str | None,
    dimensions: int | None,
    normalize: bool | None,
    truncate: bool,
    base64_vectors: bool,
    window: int,
    priority: str,
) -> None:
    """Embed every text of a JSONL file with the fleet's embedding model, with a progress bar;
    vectors in input order. A worker killed mid-job hands its texts to another (or to itself,
    restarted); this command interrupted? Run it again: it resumes without embedding a text twice.

    \b
    Each line of TEXTS.jsonl is a JSON string (the text) or an object with "prompt" (text) or
    "input_ids" (token ids), e.g.
      "A cat sits on the mat."
      {"prompt": "Queues decouple callers from workers.", "priority": "interactive"}
    Each output line has "index", "id", "embedding" (floats, or base64 with --base64) and "usage",
    or "error". Exits 1 when any text failed."""
    from tqdm import tqdm

    from tokenfleet.producer import Client, bulk
    from tokenfleet.producer.embeddings import embed_spec

    defaults: dict[str, Any] = {"priority": priority, "embed": embed_spec(dimensions, normalize, truncate)}
    url, pre = redis_url_from_env(redis_url), prefix_from_env(prefix)
    with one_line_errors():
        check_tokenizer_dir(model_dir)
        total = len(bulk.read_inputs(input_path, defaults))
        with Client(url, model=model_dir, prefix=pre) as client, tqdm(total=total, unit="text") as bar:
            counts = bulk.run_batch(
                client, input_path, output_path, defaults, window, bar.update, base64_vectors=base64_vectors
            )
    click.echo(
        f"{counts['done']} done, {counts['failed']} failed, {counts['skipped']} already in {output_path}"
    )
    if counts["failed"]:
        raise SystemExit(1)
