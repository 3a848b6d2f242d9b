"""The `llmc` command's entry point. Importing the command line takes a moment (click, rich, numpy); a Ctrl-C
then is one line and exit 130, as it is once a command runs (cli._Main)."""

import sys


def _hold_closed_descriptors() -> None:
    """Started with standard output or error closed (`>&-`, `2>&-`): /dev/null takes the descriptor before anything
    is opened, or the next file llmc opens would get it and receive what was meant for the terminal. (Python may
    have made a stream over the closed descriptor anyway, or none.) Standard error then goes nowhere; standard
    output is failed at its first write (commands/main.py), being left None here."""
    import fcntl
    import os
    for fd, name in ((1, "stdout"), (2, "stderr")):
        try:  # (open for reading only: a file a wrapper script's shell opened on the free descriptor, not an output)
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY:
                continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_WRONLY)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        stream = None if name == "stdout" else open(os.devnull, "w")
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def run() -> None:
    _hold_closed_descriptors()
    try:
        from llmc_cli.commands import interrupts, main
        interrupts.own_process()
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        sys.exit(130)
    main()
