"""``tokenfleet``: the command line. Thin: it parses, builds objects and calls them."""

from __future__ import annotations

import click

from tokenfleet.cli import dashboard, demo, embed, fleet, lora, models, requests, serve, worker


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="tokenfleet")
def main() -> None:
    """Serve LLM text generation from a fleet of workers fed by Redis Streams.

    \b
    Try it:     tokenfleet demo
    Run a fleet:
      tokenfleet model get smollm2 ./smollm2           # or `model init ./tiny`, or any local HF causal LM
      tokenfleet worker --model ./smollm2              # as many as you like, anywhere
      tokenfleet submit "Hello"                        # streams tokens to stdout
      tokenfleet serve --port 8000                     # OpenAI's API: /v1/chat/completions
    Embed: a worker on `tokenfleet model get minilm ./minilm` (its own --prefix), then
      tokenfleet embed texts.jsonl -o vectors.jsonl    # or /v1/embeddings, client.embed(texts)
    """


for command in (
    models.model,
    worker.worker,
    serve.serve,
    requests.submit,
    requests.result,
    requests.cancel,
    fleet.status,
    dashboard.dashboard,
    fleet.batch,
    embed.embed,
    fleet.rq_worker,
    fleet.acl,
    lora.lora,
    demo.demo,
):
    main.add_command(command)

__all__ = ["main"]
