"""Offline throughput benchmark (placeholder until the harness lands)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("offline", help="offline engine throughput against transformers and vLLM CPU")
    p.set_defaults(func=lambda a: 0)
