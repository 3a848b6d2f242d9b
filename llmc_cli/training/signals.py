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
        self._wakeup: tuple[int, int] | None = None  # (read end, write end) of the pipe that counts signals
        self._old_wakeup = -1

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

    def _arrived(self) -> int:
        """How many of SIGNALS reached the process since the last call (at least the one being handled). Python runs
        a handler once for all the signals of one number that arrived while the main thread was inside a long C
        call (a matmul, a device wait): a quick second Ctrl-C was lost, and the run wrote its checkpoint instead of
        aborting. The C-level handler writes one byte per signal to the wakeup fd, which counts them."""
        if self._wakeup is None:
            return 1
        ours = {int(getattr(signal, n)) & 0xFF for n in self.SIGNALS if hasattr(signal, n)}
        n = 0
        try:
            while chunk := os.read(self._wakeup[0], 4096):
                n += sum(1 for b in chunk if b in ours)
        except (BlockingIOError, InterruptedError, OSError):
            pass
        return max(n, 1)

    def _handler(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        arrived = self._arrived()
        if self.requested is None:
            self.requested = name
            self._note(f"{name}: finishing the current step, then writing a checkpoint "
                       f"(send it again to abort at once)")
            if arrived < 2:
                return
        self.restore()
        raise TrainAborted(name)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:  # (nohup's SIGHUP stays ignored)
                    self._old[sig] = signal.signal(sig, self._handler)
            self._count_signals()  # (after the handlers: a signal before them is the other handler's, not counted)
        return self

    def _count_signals(self) -> None:
        """A wakeup fd for _arrived, unless the program has one of its own (an event loop's), which stays."""
        try:
            r, w = os.pipe()
        except OSError:
            return
        try:
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (OSError, ValueError):
            os.close(r)
            os.close(w)
            return
        if old != -1:
            signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            return
        self._wakeup = (r, w)

    def restore(self) -> None:
        for sig, old in self._old.items():
            try:
                signal.signal(sig, old)
            except (ValueError, TypeError):
                pass
        self._old = {}
        if self._wakeup is not None:
            try:
                signal.set_wakeup_fd(-1)
            except ValueError:
                pass
            for fd in self._wakeup:
                os.close(fd)
            self._wakeup = None

    def __exit__(self, *exc) -> None:
        self.restore()
