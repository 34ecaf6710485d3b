"""`trtllm-qwenvl SUBCOMMAND ...`: each subcommand owns its own argument parser."""
import sys

from .models import tiny
from .serve import cli as serve

COMMANDS = {"make-tiny": tiny.main, "serve": serve.main}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        sys.exit(f"usage: trtllm-qwenvl {{{','.join(COMMANDS)}}} ...")
    COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
