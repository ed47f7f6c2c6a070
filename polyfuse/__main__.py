"""``python -m polyfuse serve ...`` (the OpenAI-compatible server) and ``python -m polyfuse generate ...``
(run_generation.py); the ``polyfuse`` console script is the same."""

from __future__ import annotations

import sys


COMMANDS = {"serve": "the OpenAI-compatible server (docs/serving.md)", "generate": "run_generation.py's CLI"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: polyfuse {serve,generate} [options]\n")
        for name, what in COMMANDS.items():
            print(f"  {name:10} {what}")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from polyfuse.serving.server import main as serve

        return serve(rest)
    if command == "generate":
        from polyfuse.cli.generate import main as generate

        return generate(rest)
    print(f"error: unknown command {command!r} (choose from {', '.join(COMMANDS)})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
