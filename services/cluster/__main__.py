"""``python -m services.cluster up|serve|status``: the cluster commands alone, without importing the
model-running commands (and torch) that ``tokenmill`` registers too. The launcher starts its children this way."""

from __future__ import annotations

import argparse
import logging
import sys

from common import machine
from services.cluster.cli import add_parsers


def main(argv: list[str] | None = None) -> int:
    machine.use_huge_pages()  # a worker started alone (Ray, a container) sets it before its engine allocates
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(prog="tokenmill", description="Tokenmill cluster commands.")
    add_parsers(p.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = p.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
