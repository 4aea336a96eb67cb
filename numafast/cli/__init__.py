"""The ``numafast`` command: one subcommand per module of this package."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from numafast.cli import bench, check, plan, run, show
from numafast.cli.arguments import UsageError

# Each subcommand module has add_parser(subparsers) and run(args) -> int.
SUBCOMMANDS = [show, plan, run, check, bench]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="numafast",
        description="NUMA placement for deep-learning input pipelines.",
        epilog="With no COMMAND, numafast runs show. Each command's options: numafast COMMAND --help.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    args = parser.parse_args(argv)
    if args.command is None:
        print(f"numafast: no command given, running show (commands: {', '.join(subparsers.choices)}; "
              "numafast --help)", file=sys.stderr)  # fmt: skip
        args = parser.parse_args(["show"])
    formatwarning = warnings.formatwarning
    warnings.formatwarning = _said_by(f"numafast {args.command}")
    try:
        return int(args.run(args))
    except BrokenPipeError:  # `numafast show | head`
        return 0
    except UsageError as error:
        command = subparsers.choices[args.command]
        command.print_usage(sys.stderr)
        print(f"{command.prog}: error: {error}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as error:
        print(f"numafast {args.command}: {error}", file=sys.stderr)
        return 1
    finally:
        warnings.formatwarning = formatwarning


def _said_by(prog: str) -> Callable[..., str]:
    """A ``warnings.formatwarning`` for a command: ``prog: Category: message``, as its
    errors are said, not the file and line of the library code that warned (which is
    the console script's, or ``<frozen runpy>`` under ``python -m``)."""

    def said(message: Warning | str, category: type[Warning], *_where: Any, **_line: Any) -> str:
        return f"{prog}: {category.__name__}: {message}\n"

    return said
