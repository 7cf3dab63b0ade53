"""`python -m bench kernel` (more benchmarks join as the runtime grows)."""

from __future__ import annotations

import argparse
import json
import sys

from bench import kernel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    kernel.add_arguments(commands.add_parser("kernel", help=kernel.__doc__))
    args = parser.parse_args(argv)
    result = kernel.run(args)
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
