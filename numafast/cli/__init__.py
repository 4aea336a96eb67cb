"""The ``numafast`` command: one subcommand per module of this package."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

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
