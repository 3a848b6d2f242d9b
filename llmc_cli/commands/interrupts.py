"""Ctrl-C, SIGTERM and SIGHUP outside a training loop (which stops after its step on its own, training/signals.py):
each unwinds the command as Ctrl-C does, so its temporary files and directories go and the user reads one line,
exit 130 ("stopped by a signal with nothing saved"). Left at their defaults, SIGTERM and SIGHUP killed the process
where it stood (a temporary directory of `llmc bench train` stayed in /tmp for good) and said nothing.

A second signal while the first unwinds (during the temporary files' removal, the worker pool's shutdown, the
interpreter's exit) ends the process at once, with the line said once, where Python would print a traceback from
whatever cleanup it interrupted. A signal the user ignored when starting llmc (nohup's SIGHUP, a background job's
SIGINT) stays ignored."""

from __future__ import annotations

import os
import signal
import threading

INTERRUPTED_EXIT = 130

_STATE: dict = {"pid": None, "signame": None, "said": False, "saying": False, "deferred": False, "old": {}}
_OWNED = []  # set by the `llmc` entry point: the process is llmc's, and the handlers stay until it exits


class Interrupted(KeyboardInterrupt):
    """The first SIGINT, SIGTERM or SIGHUP of a command."""

    def __init__(self, signame: str):
        super().__init__(signame)
        self.signame = signame


def interrupted_line(e: BaseException | None = None) -> str:
    name = getattr(e, "signame", None) or _STATE["signame"]
    return "interrupted" if name in (None, "SIGINT") else f"interrupted by {name}"


def _handler(signum, frame) -> None:
    if os.getpid() != _STATE["pid"]:  # a forked child (a tokenizer worker): it dies of the signal as it would have
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _STATE["signame"] is not None:  # a second signal while the first unwinds: leave now, without a traceback
        if _STATE["saying"]:  # (once the line is out: say_once ends the process then)
            _STATE["deferred"] = True
            return
        if not _STATE["said"]:
            _STATE["said"] = True
            try:
                os.write(2, f"error: {interrupted_line()}\n".encode())
            except OSError:
                pass
        _forced_exit()
    _STATE["signame"] = signal.Signals(signum).name
    raise Interrupted(_STATE["signame"])


def _forced_exit() -> None:
    """End the process now: what must not outlive it (files.temporary_directory's, the worker processes, which would
    print tracebacks into a closed pipe) goes first, as well as can be done in a hurry."""
    import shutil
    import sys
    from llmc_cli.formats.files import FORCED_EXIT_REMOVALS
    for path in list(FORCED_EXIT_REMOVALS):
        shutil.rmtree(path, ignore_errors=True)
    mp = sys.modules.get("multiprocessing")
    if mp is not None:
        try:
            for child in mp.active_children():
                child.kill()
        except Exception:  # noqa: BLE001  (a forced exit goes on whatever is left)
            pass
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(INTERRUPTED_EXIT)


def own_process() -> None:
    """The `llmc` command itself runs here: the handlers stay until the process exits (a signal during the
    interpreter's exit is still this command's)."""
    _OWNED.append(True)


def uninstall() -> None:
    """Give back the handlers install took and forget this command's state, where llmc runs inside another
    program (click's CliRunner, a test): its next signal is that program's again."""
    if _OWNED or threading.current_thread() is not threading.main_thread():
        return
    for sig, old in _STATE["old"].items():
        if signal.getsignal(sig) is _handler:
            signal.signal(sig, old)
    _STATE.update(pid=None, signame=None, said=False, saying=False, deferred=False, old={})


def install() -> None:
    """Take SIGINT, SIGTERM and SIGHUP for this process (the main thread's only), where they are at their
    defaults."""
    _STATE.update(signame=None, said=False, saying=False, deferred=False)
    if threading.current_thread() is not threading.main_thread():
        return
    _STATE.update(pid=os.getpid(), old={})
    for name, default in (("SIGINT", signal.default_int_handler), ("SIGTERM", signal.SIG_DFL),
                          ("SIGHUP", signal.SIG_DFL)):
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is default:
            _STATE["old"][sig] = signal.signal(sig, _handler)


def fail_interrupted(e: BaseException, then: str = "") -> None:
    """A command's line for interruption `e` (`interrupted_line`, followed by `then`), said once; exit 130."""
    from llmc_cli.commands.console import fail
    line = interrupted_line(e) + then
    say_once(lambda: fail(line, code=INTERRUPTED_EXIT))


def say_once(say) -> None:
    """`say()` the interruption's line, which a second signal arriving meanwhile does not say again: that signal ends
    the process once the line is out. (A signal mask would not do: any thread of the process, OpenBLAS's among them,
    may take a signal that the main thread blocks, and Python then runs the handler in the main thread anyway.)"""
    if _STATE["said"]:
        return
    _STATE["said"] = _STATE["saying"] = True
    if _STATE["signame"] is None:  # (a KeyboardInterrupt of Python's own, before install or from a library)
        _STATE["signame"] = "SIGINT"
    try:
        say()
    finally:
        _STATE["saying"] = False
        if _STATE["deferred"]:
            _forced_exit()
