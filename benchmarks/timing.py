"""--threads and --clock, for benchmarks that time work on a machine others may share."""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, help="torch (and native kernel) threads")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: process CPU time, for a shared machine (only meaningful with --threads 1)")


def clock_of(args: argparse.Namespace) -> Callable[[], float]:
    """Applies --threads, and returns the clock --clock names."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return time.process_time if args.clock == "cpu" else time.perf_counter
