"""`python -m bench kernel | loops | abort | scale | stream | agents | ray | instructions | hooks`: ratios to an in-run
baseline, JSON last. `python -m bench durability`: counts of what SIGKILLs at random moments lost (none, or a bug).
`python -m bench tricks`: which of the hot path's speed and memory tricks still hold (all, or a regression).

Each but `instructions`, `durability` and `tricks` takes `--profile FILE`: a cProfile of its runtime side, for
`python -m pstats FILE` or `snakeviz FILE`.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench import abort, agents, durability, hooks, instructions, kernel, loops, ray_shards, scale, stream, tricks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    modules = {
        "kernel": kernel,
        "loops": loops,
        "abort": abort,
        "scale": scale,
        "stream": stream,
        "agents": agents,
        "ray": ray_shards,
        "durability": durability,
        "instructions": instructions,
        "tricks": tricks,
        "hooks": hooks,
    }
    for name, module in modules.items():
        doc = module.__doc__ or ""
        module.add_arguments(
            commands.add_parser(
                name,
                help=doc.splitlines()[0],
                description=doc,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
        )
    args = parser.parse_args(argv)
    result = modules[args.command].run(args)
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
