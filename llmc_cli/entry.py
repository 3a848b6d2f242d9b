"""The `llmc` command's entry point. Importing the command line takes a moment (click, rich, numpy); a Ctrl-C
then is one line and exit 130, as it is once a command runs (cli._Main)."""

import sys


def run() -> None:
    try:
        from llmc_cli.commands import interrupts, main
        interrupts.own_process()
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        sys.exit(130)
    main()
