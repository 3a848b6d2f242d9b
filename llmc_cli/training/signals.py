"""A graceful stop: the first SIGINT/SIGTERM/SIGHUP becomes a request the training loop honours after the current
step (then it checkpoints, and `llmc train` exits 75); a second signal raises ``TrainAborted`` at once."""

from __future__ import annotations

import os
import signal
import threading


# ---- signals ----------------------------------------------------------------------------------------------------
class TrainAborted(KeyboardInterrupt):
    """A second SIGINT/SIGTERM while the first was still being honoured: stop now, write nothing more."""

    def __init__(self, signame: str):
        super().__init__(signame)
        self.signame = signame


class StopSignals:
    """Context manager: the first SIGINT/SIGTERM sets ``requested`` (the loop finishes its step, checkpoints and
    returns); a second one raises TrainAborted from wherever the main thread is. Outside the main thread it
    installs nothing."""

    SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")  # SIGHUP: the terminal or ssh session went away

    def __init__(self, note=None):
        self.requested: str | None = None
        self._old: dict[int, object] = {}
        self._note = note if note is not None else self._stderr

    @staticmethod
    def _stderr(msg: str) -> None:
        try:
            os.write(2, (msg + "\n").encode())
        except OSError:
            pass

    def request(self, why: str) -> None:
        """A stop asked for by something other than a signal (standard output's reader gone): honoured as the first
        signal is, after the current step."""
        if self.requested is None:
            self.requested = why
            self._note(f"{why}: finishing the current step, then writing a checkpoint")

    def _handler(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested = name
            self._note(f"{name}: finishing the current step, then writing a checkpoint "
                       f"(send it again to abort at once)")
            return
        self.restore()
        raise TrainAborted(name)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:  # (nohup's SIGHUP stays ignored)
                    self._old[sig] = signal.signal(sig, self._handler)
        return self

    def restore(self) -> None:
        for sig, old in self._old.items():
            try:
                signal.signal(sig, old)
            except (ValueError, TypeError):
                pass
        self._old = {}

    def __exit__(self, *exc) -> None:
        self.restore()
