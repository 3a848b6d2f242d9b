"""The `llmc` group: every command registered, and the last line of defence that turns stray errors into one line."""

from __future__ import annotations

import errno
import io
import os
from contextlib import contextmanager

import click

from llmc_cli import __version__, naming
from llmc_cli.commands.console import fail, one_line
from llmc_cli.commands.options import usage_error_line


def _tolerant_streams() -> None:
    """A terminal whose encoding cannot show a character (PYTHONIOENCODING=ascii, a Latin-1 locale) shows it as an
    escape: a path or a sampled word with an é must not end a run with UnicodeEncodeError. (Streams already set to
    carry undecodable bytes, surrogateescape under the C locale, stay as they are.)"""
    import sys
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) == "strict":
            try:
                stream.reconfigure(errors="backslashreplace")
            except (AttributeError, ValueError, OSError):  # (not a TextIOWrapper: a test's, a pipe's wrapper)
                pass


STDOUT_NAME = "standard output"  # how an error writing it names it (`error: standard output: No space left on device`)
BROKEN_PIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a Unix tool that a closed pipe ended


class StdoutClosed(BaseException):
    """Standard output's reader has gone (`llmc ... | head -1`): the command ends quietly, as a Unix tool that SIGPIPE
    ends does. A BaseException, so that no command's `except OSError` reports it as a failure of its own; cleanups
    (`finally`, temporary files) still run. A broken pipe in a file llmc writes stays an OSError naming that file."""


class _Fd(io.RawIOBase):
    """A standard stream's file descriptor under a text layer; subclasses say what a failed write means."""

    def __init__(self, fd: int):
        super().__init__()
        self._fd, self._failed = fd, False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)


class _StdoutFd(_Fd):
    """Standard output's file descriptor, written as FileIO writes it, whose errors say they are standard output's:
    EPIPE is StdoutClosed, any other an OSError naming STDOUT_NAME. After one, the rest goes nowhere, so that the exit
    (its flush of what is left) does not fail a second time."""

    name = "<stdout>"

    def __init__(self, fd: int, closed: bool = False):
        super().__init__(fd)
        self._closed = closed

    def write(self, b) -> int | None:
        if self._failed:
            return memoryview(b).nbytes
        if self._closed:  # (started with it closed: what the command says would be lost, and so is its result)
            self._failed = True
            raise OSError(errno.EBADF, "closed when llmc started (>&-)", STDOUT_NAME)
        try:
            return os.write(self._fd, b)
        except BlockingIOError:  # (a non-blocking descriptor that is full: as FileIO answers)
            return None
        except OSError as e:
            self._failed = True
            if e.errno == errno.EPIPE:
                from llmc_cli.commands.console import STDOUT_CLOSED
                if STDOUT_CLOSED:  # the command would rather finish its work than end here
                    for callback in STDOUT_CLOSED:
                        callback()
                    return memoryview(b).nbytes
                raise StdoutClosed() from None
            raise OSError(e.errno, e.strerror, STDOUT_NAME) from None


class _StderrFd(_Fd):
    """Standard error's file descriptor, whose write errors (a full disk, `2>/dev/full`; a reader gone) drop what
    follows: nothing can be said about them, and a command's exit code is its own (0 with a warning it could not
    print, 2 for an error line that went nowhere), never a traceback's 1."""

    name = "<stderr>"

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        done = 0
        while not self._failed and done < len(view):  # (all of it: the text layer above has no buffer to retry)
            try:
                done += os.write(self._fd, view[done:])
            except InterruptedError:
                continue
            except OSError:
                self._failed = True
        return len(view)


def _own_fd(stream, original) -> int | None:
    """The descriptor under `stream`, flushed, where it is the process's own text stream (not a test's capture)."""
    if stream is not original or not isinstance(stream, io.TextIOWrapper):
        return None
    try:
        fd = stream.fileno()
        stream.flush()
    except (OSError, ValueError):
        return None
    return fd


def _guard_stderr() -> None:
    """Standard error (the process's own) rewrapped over _StderrFd, same encoding and buffering."""
    import sys
    err = sys.stderr
    if (fd := _own_fd(err, sys.__stderr__)) is None:
        return
    sys.stderr = io.TextIOWrapper(_StderrFd(fd), encoding=err.encoding, errors=err.errors, newline="\n",
                                  line_buffering=err.line_buffering, write_through=True)  # (unbuffered, as Python's)


def _guard_stdout() -> None:
    """Standard output (the process's own, not a test's capture) rewrapped over _StdoutFd, same encoding and
    buffering; its last flush at exit may then fail only quietly (the command already reported its own end)."""
    import atexit
    import sys
    _closed_at_start()
    out = sys.stdout
    if (fd := _own_fd(out, sys.__stdout__)) is None:
        return
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(_StdoutFd(fd)), encoding=out.encoding, errors=out.errors,
                                  newline="\n", line_buffering=out.line_buffering, write_through=out.write_through)
    atexit.register(_flush_quietly)


def _closed_at_start() -> None:
    """Started with standard output closed (`>&-`: sys.stdout is None; entry.py has put /dev/null on the
    descriptor): its first write fails, so a command whose result is its output does not end in success with the
    result lost. A closed standard error goes nowhere (nothing can be said)."""
    import sys
    if sys.stdout is None:
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(_StdoutFd(-1, closed=True)), encoding="utf-8", newline="\n")
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")


def _check_working_directory() -> None:
    """Relative paths are made absolute from the working directory: one deleted under the shell (`rmdir` of it
    elsewhere) made every such path fail with a bare "No such file or directory" naming no file."""
    try:
        os.getcwd()
    except FileNotFoundError:
        fail("the current directory no longer exists (deleted while this shell was in it); cd to a directory "
             "that does")
    except OSError:  # (a path too long for getcwd: relative paths still work through the kernel)
        pass


def _flush_quietly() -> None:
    import sys
    try:
        sys.stdout.flush()
    except (StdoutClosed, OSError, ValueError):
        pass


def _note(message: str) -> None:
    """A reader's note (llmc_cli.formats.notes) as one line on stderr; of data parallel ranks, rank 0's alone."""
    from llmc_cli.commands.console import _RANK, err_console, printable
    if _RANK.get("rank", 0) == 0:
        err_console.print(f"note: {printable(message)}", markup=False, highlight=False, soft_wrap=True)


# click >= 8.2 raises it for a group given no command: its help, on stderr, exit 2 (8.1 printed it and exited 0)
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


@contextmanager
def _one_line_errors():
    """What the group's own options (make_context) and every command (invoke) end in: a success whose output cannot
    be written is no success; a reader that went away a quiet 141; a bad option, a misspelt command or a file
    system's refusal one line."""
    import sys
    try:
        try:
            yield
        except (SystemExit, click.exceptions.Exit) as e:
            if (e.code if isinstance(e, SystemExit) else e.exit_code) in (0, None) and sys.stdout is not None:
                sys.stdout.flush()  # (--help, --version, a command done: their output meets its write error here)
            raise
    except StdoutClosed:
        sys.exit(BROKEN_PIPE_EXIT)
    except _NO_ARGS_IS_HELP:  # `llmc bench` alone: its help as `llmc` alone shows it, not squeezed into a line
        raise
    except click.UsageError as e:  # a bad option value or a misspelt command: one line, exit 2
        fail(usage_error_line(e), code=e.exit_code)
    except OSError as e:  # a full disk, a read-only file system, no permission: the path and the reason
        fail(one_line(e))


class _Main(click.Group):
    """Last line of defence: a missing optional package or exhausted memory is one line, not a traceback."""

    def make_context(self, info_name, args, parent=None, **extra):
        """The group's own options are read here, before `invoke`: `--help` and `--version` printed into a full
        disk or a closed pipe (a traceback, exit 1, or exit 0 with the text lost under `>&-`) and a misspelt
        `llmc --bogus` (click's four-line usage) get the same streams and one-line errors as every command."""
        _tolerant_streams()
        _guard_stdout()
        _guard_stderr()
        with _one_line_errors():
            return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx):
        from llmc_cli.commands import interrupts
        from llmc_cli.formats import notes
        _tolerant_streams()
        _guard_stdout()
        _guard_stderr()
        interrupts.install()
        was = notes.listen(_note)
        try:
            with naming.flags():  # the layers below name flags, not Python arguments, in what they raise
                return self._invoke(ctx)
        finally:
            interrupts.uninstall()  # (in-process use only: the `llmc` command keeps them until it exits)
            notes.listen(was)

    def _invoke(self, ctx):
        import sys

        from llmc_cli.commands import interrupts
        with _one_line_errors():
            try:
                _check_working_directory()
                rv = super().invoke(ctx)
                if sys.stdout is not None:  # (None: started with standard output closed, `>&-`)
                    sys.stdout.flush()  # output held back (a pipe, a file) meets its write error here, not at exit
                return rv
            except ModuleNotFoundError as e:
                from llmc_cli.commands.console import missing_package_message
                fail(missing_package_message(e))
            except MemoryError as e:
                fail(f"out of host memory ({str(e) or 'MemoryError'}); lower -b/--batch-size or -t/--seq-len, or "
                     "the model's size")
            except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM, SIGHUP outside a training loop (stops on its own)
                interrupts.fail_interrupted(e)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="llmc")
def main() -> None:
    """llmc: train GPT-2 and Llama 3 from scratch, llm.c style, on whatever hardware is here.

    \b
    Example:
      llmc tokenize shakespeare
      llmc train --backend cpu --model d6 -b 4 -t 64 --steps 50 --out checkpoints/demo
      llmc sample --checkpoint checkpoints/demo --prompt "ROMEO:"
    """


def _register() -> None:
    """Every command lives in its own module; they import the consoles below them, never this group."""
    from llmc_cli.commands import backends, bench, eval, plot, sample, tokenize, train
    from llmc_cli.commands.convert import convert
    for cmd in (tokenize.tokenize, train.train, sample.sample, eval.eval_cmd, convert, bench.bench, plot.plot,
                backends.backends):
        main.add_command(cmd)


_register()
