"""The kernel options (polyfuse/core/kernel_options.py) as CLI flags of polyfuse-generate / run_generation.py: one
flag per option, named as the option, with its default and meaning in --help; ``kernel_flags(args)`` gives them to
the run's flags, and ``--print_backends`` names those set to something else than their default."""

from __future__ import annotations

import argparse
import os

from polyfuse.core.kernel_options import DEFAULT, FIELDS


def _folder(value: str) -> str:
    if value and not os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a folder")
    return value


def add_kernel_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("kernel options (also from_pretrained keywords; --print_backends names those set)")
    for name, f in FIELDS.items():
        default = getattr(DEFAULT, name)
        if isinstance(default, bool):
            g.add_argument(
                f"--{name}", action=argparse.BooleanOptionalAction, default=default, help=f.metadata["help"]
            )
        else:
            g.add_argument(f"--{name}", default=default, type=_folder, metavar=f.metadata["metavar"] or None,
                           help=f.metadata["help"])  # fmt: skip


def kernel_flags(args) -> dict:
    """{option: value} of the parsed arguments, for the run's flags."""
    return {name: getattr(args, name) for name in FIELDS if hasattr(args, name)}
