"""The ``tokenmill`` command: one entry point, a subcommand per job."""

from __future__ import annotations

import argparse
import logging
import sys

from common import machine


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenmill",
        description="Tokenmill: a token-level LLM inference-serving cluster.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from services import generate  # imports the engine (torch): not for `tokenmill health`

    generate.add_parser(sub)
    from services.cluster import cli as cluster_cli

    cluster_cli.add_parsers(sub)
    from loadgen import cli as bench_cli

    bench_cli.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    machine.use_huge_pages()  # before torch allocates anything, here or in the processes started from here
    if argv[:1] in (["health"], ["ray"], ["profile"]):  # health: every few seconds in a container; none needs the engine
        from services.cluster.__main__ import main as cluster_main

        return cluster_main(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
