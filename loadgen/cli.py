"""``tokenmill bench …``: the benchmarks."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (offline engine throughput, serving load)")
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    from loadgen import (
        bench_control_plane,
        bench_disagg,
        bench_fuzz,
        bench_gpu_serving,
        bench_offline,
        bench_output_filter,
        bench_resilience,
        bench_serve,
        bench_serving_peer,
        bench_structured,
        bench_tenants,
        report,
    )

    bench_offline.add_parser(bsub)
    bench_control_plane.add_parser(bsub)
    bench_serve.add_parser(bsub)
    bench_serving_peer.add_parser(bsub)
    bench_gpu_serving.add_parser(bsub)
    bench_disagg.add_parser(bsub)
    bench_fuzz.add_parser(bsub)
    bench_resilience.add_parser(bsub)
    bench_output_filter.add_parser(bsub)
    bench_structured.add_parser(bsub)
    bench_tenants.add_parser(bsub)
    report.add_compare_parser(bsub)
