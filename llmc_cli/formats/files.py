"""Writing files so that a crash or a full disk never leaves a half-written one under the real name: a temporary
sibling, fsync, rename (and fsync of the directory). Also what may be replaced: only a file of the kind being
written, recognised by its magic number."""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

# ----------------------------------------------------------------------------------------------
# writing


def sibling_stem(name: str) -> str:
    """What the hidden siblings of a file named `name` (temporaries, locks: `.STEM.PID.tmp`) start with: the name
    itself, or, where those would pass a file system's 255-byte limit on a name that is itself legal, its first
    160 bytes and a digest of the whole."""
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) <= 200:
        return name
    import hashlib
    head = raw[:160].decode("utf-8", "ignore")  # (a character cut in two is dropped)
    return f"{head}~{hashlib.sha256(raw).hexdigest()[:16]}"


@contextmanager
def atomic_file(path: str | os.PathLike, suffix: str = ".tmp", through_links: bool = False) -> Iterator[Path]:
    """Yields a temporary sibling of `path` to write; when the block ends without an error the file is fsynced and
    renamed over `path` (and the directory fsynced), so `path` is never seen half-written. On an error the
    temporary file goes, and an OSError names `path`, never the temporary name. Every llmc write goes here."""
    path = Path(path)
    if through_links and path.is_symlink() and path.is_file():  # a user's output named through a link, its file
        # checked as one of the kind written (check_replaceable, a PNG's magic): written through, as `>` writes, the
        # link kept (a rename over the link would leave its file stale). llmc's own files (`latest`, state) are not:
        # a link planted there would have llmc write into whatever file it names.
        path = Path(os.path.realpath(path))
    made = make_folders(path.parent)
    tmp = path.with_name(f".{sibling_stem(path.name)}.{os.getpid()}{suffix}")
    remove_dead_siblings(path, suffix)  # what an earlier writer of `path` killed mid-write (SIGKILL, SIGTERM) left
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            keep_mode_of(path, f.fileno())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink()
        except OSError:  # never created (on a read-only file system unlink says so rather than ENOENT)
            pass
        remove_made_folders(made)  # (a failed download left the empty dataset folder made for it)
        if isinstance(e, OSError) and e.errno is not None:  # name the file being written, not its temporary name
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    fsync_dir(path.parent)  # make the rename itself durable


def keep_mode_of(path: str | os.PathLike, fd: int) -> None:
    """The file open at `fd`, about to replace the regular file at `path`, takes that file's permission bits and,
    where this process may, its owner and group: a user's private (0600, 0640) log, config or shard rewritten under a
    new name would otherwise come back with the umask's 0644. Nothing there (or a link, a directory): as created."""
    import stat
    try:
        old = os.stat(path, follow_symlinks=False)
    except OSError:
        return
    if not stat.S_ISREG(old.st_mode):
        return
    try:
        new = os.fstat(fd)
        if (new.st_uid, new.st_gid) != (old.st_uid, old.st_gid):
            os.fchown(fd, old.st_uid, old.st_gid)  # (before the mode: a chown clears set-id bits)
    except OSError:  # (only root gives a file away; a group this user is not in is refused too)
        pass
    try:
        os.fchmod(fd, stat.S_IMODE(old.st_mode))
    except OSError:  # (a file system without Unix modes)
        pass


def make_folders(folder: str | os.PathLike) -> list[Path]:
    """`folder` and its missing parents created (mkdir -p); returns those it created, deepest first, for
    remove_made_folders when the write they were made for fails (a failed command leaves no folder of its own)."""
    folder = Path(folder)
    made: list[Path] = []
    try:
        # one level at a time, top down, each counted only where this mkdir made it: a folder that another process
        # (a second writer of the same new parent) made after it was found missing is that process's, never removed
        for d in reversed([d for d in (folder, *folder.parents) if not os.path.lexists(d)]):
            try:
                d.mkdir()
            except FileExistsError:
                continue
            except OSError:
                break  # (mkdir -p below says why, in its own words)
            made.insert(0, d)
        folder.mkdir(parents=True, exist_ok=True)
    except BaseException:
        remove_made_folders(made)
        raise
    return made


def remove_made_folders(made: Sequence[Path]) -> None:
    """Removes the folders make_folders created that are still empty, deepest first (rmdir leaves one another writer
    has put something in)."""
    for d in made:
        try:
            d.rmdir()
        except OSError:  # (never made, as mkdir stopped above it; not empty; or not searchable: its parent is tried)
            continue


def remove_dead_siblings(path: str | os.PathLike, suffix: str = ".tmp") -> list[Path]:
    """Remove what a writer of `path` left beside it when it was killed before it could clean up (SIGKILL, SIGTERM,
    a power cut), for that one name only and only where the writer's pid is gone from this machine: atomic_file's
    `.<name>.<pid><suffix>`, and the `.<name>.tmp-<pid>` / `.<name>.old-<pid>` folders (or files, or links) that a
    directory written beside and swapped in leaves (replace_dir). Returns what went; a live process's stays."""
    import re
    path = Path(path)
    stem = sibling_stem(path.name)
    form = re.compile(rf"\.{re.escape(stem)}\.(?:(\d+){re.escape(suffix)}|(?:tmp|old)-(\d+))")
    gone = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return gone
    head = f".{stem}."
    for e in entries:
        if not e.name.startswith(head):  # (a cheap test first: a directory of ten thousand shards is scanned per write)
            continue
        m = form.fullmatch(e.name)
        if m is None:
            continue
        pid = int(m.group(1) or m.group(2))
        if pid == os.getpid() or _alive(pid):
            continue
        try:
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path)
            else:
                os.unlink(e.path)
            gone.append(Path(e.path))
        except OSError:
            pass
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # (OverflowError: a number past any pid)
        return False
    except PermissionError:  # another user's process
        return True
    return True


class DirectoryLock:
    """Exclusive ownership of what one llmc process writes in a directory, for that process's life: flock on
    DIR/<name>, which holds the owner's pid for the message another process prints. (Two writers would interleave
    their files: a run's checkpoints, a corpus' shards and manifest.)

    `acquire` creates the directory (and its parents) if needed; `release` removes the lock file, and the folders
    acquire created that are still empty (a command that failed before writing anything)."""

    def __init__(self, directory: str | os.PathLike, name: str, option: str, what: str,
                 error: type[Exception] = OSError, instead: str = "give another directory", label: str | None = None):
        self.directory = Path(directory)
        self.name, self.option, self.what, self.error, self.instead = name, option, what, error, instead
        self.label = label  # how messages name what is locked (a file in the directory); default: OPTION DIRECTORY
        self._fd: int | None = None
        self._made: list[Path] = []  # the folders acquire created, deepest first

    def acquire(self) -> "DirectoryLock":
        path = self.directory / self.name
        where = self.label or f"{self.option} {self.directory}"
        try:
            self._made = make_folders(self.directory)
        except OSError as e:
            raise self.error(f"{where}: cannot create {self.what} ({e.strerror or e})") from None
        try:
            return self._lock(path, where)
        except BaseException:  # (refused, or no lock file possible: the folders made for it go again)
            remove_made_folders(self._made)
            raise

    def _lock(self, path: Path, where: str) -> "DirectoryLock":
        import fcntl
        while True:
            try:  # never through a link: the pid written below would replace the file it points to, anywhere
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise self.error(f"{where}: its lock file {self.name} is a symbolic link; llmc writes its lock "
                                     "only into a file of its own, so remove the link") from None
                raise self.error(f"{where}: cannot create its lock file {self.name} ({e.strerror or e})") from None
            if not self._ours(fd):  # (a user's file under the lock's name is removed when the lock is let go)
                os.close(fd)
                raise self.error(f"{where}: {path} is not an llmc lock file (a process id), so llmc will not use or "
                                 "remove it; move it") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise self.error(f"{where} is in use by another llmc process (pid {holder}); wait for it to finish "
                                 f"or stop it, or {self.instead}; nothing was changed") from None
            except OSError as e:  # a file system without locks: say so rather than run unprotected
                os.close(fd)
                raise self.error(f"{where}: cannot lock {self.name} ({e.strerror or e}); this file system does not "
                                 "support file locks") from None
            try:  # the holder unlinks the file as it lets go: a lock on an unlinked file guards nothing
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        try:  # who holds it, for the message another process prints
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass
        self._fd = fd
        return self

    @staticmethod
    def _ours(fd: int) -> bool:
        """A regular file, empty (new, or its writer killed before the pid) or holding a process id."""
        import stat
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        if st.st_size == 0:
            return True
        head = os.pread(fd, 33, 0)
        return len(head) <= 32 and head.strip().isdigit()

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:  # unlinked while still held, so no one can lock the old file after us (see acquire)
            (self.directory / self.name).unlink()
        except OSError:
            pass
        remove_made_folders(self._made)  # what acquire created and nothing was written into after all
        os.close(fd)  # closing drops the flock

    def __enter__(self) -> "DirectoryLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


FORCED_EXIT_REMOVALS: list = []  # what a forced exit (a second signal: commands/interrupts.py) removes on its way out


@contextmanager
def temporary_directory(prefix: str):
    """tempfile.TemporaryDirectory that a forced exit removes too (it skips the unwinding that removes the other)."""
    import tempfile
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        FORCED_EXIT_REMOVALS.append(tmp)
        try:
            yield tmp
        finally:
            FORCED_EXIT_REMOVALS.remove(tmp)


def atomic_write_bytes(path: str | os.PathLike, data: bytes | Sequence[bytes], through_links: bool = False) -> None:
    """Write ``data`` to ``path`` atomically (see atomic_file)."""
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    with atomic_file(path, through_links=through_links) as tmp, open(tmp, "wb") as f:
        for c in chunks:
            f.write(c)


def replace_dir(tmp: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Put the finished directory `tmp` in `dst`'s place: a `dst` already there is moved aside first and dropped
    only after the new one stands, so at every moment one complete version exists under `dst` or beside it."""
    tmp, dst = Path(tmp), Path(dst)
    if dst.exists():
        old = dst.parent / f".{sibling_stem(dst.name)}.old-{os.getpid()}"
        os.replace(dst, old)
        os.replace(tmp, dst)
        if old.is_symlink():  # (a link to the old directory: rmtree refuses links, and the link stayed behind)
            old.unlink()
        else:
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)


def write_dir_beside(dst: str | os.PathLike, write, place=replace_dir) -> None:
    """`write(tmp)` fills a temporary sibling of `dst` (`.NAME.tmp-PID`), which `place(tmp, dst)` then puts in
    `dst`'s place (replace_dir: the old `dst` is dropped only after the new one stands), so a failure leaves `dst`
    as it was. What a killed writer of `dst` left beside it goes first; this call's temporary never outlives it."""
    dst = Path(dst)
    tmp = dst.parent / f".{sibling_stem(dst.name)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    made: list[Path] = []
    try:
        made = make_folders(dst.parent)
        remove_dead_siblings(dst)
        write(tmp)
        place(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_made_folders(made)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def non_folder_above(path: str | os.PathLike) -> Path | None:
    """The nearest of `path`'s parents (spelt as `path` is) that exists, when it is not a directory: folders made
    for a write would fail there with only "File exists" or "Not a directory", naming neither."""
    above = next((p for p in Path(path).parents if os.path.lexists(p)), None)
    return above if above is not None and not above.is_dir() else None


def check_replaceable(path: str | os.PathLike, magics: Sequence[int], what: str) -> None:
    """llmc writes over a file only when it is one of its own kind (its int32 magic number is one of `magics`);
    anything else at `path` is the user's and is refused before a byte is written."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    try:
        head = np.fromfile(path, dtype="<i4", count=1) if path.is_file() else np.zeros(0, "<i4")
    except OSError:
        head = np.zeros(0, "<i4")
    if head.size < 1 or int(head[0]) not in magics:
        raise DataError(f"{path}: exists and is not an llm.c {what}, so llmc will not replace it; move it or "
                        "choose another path")


def read_at_most(path: str | os.PathLike, limit: int) -> bytes | None:
    """The whole of `path` when it holds at most `limit` bytes, else None: a regular file is judged by its size before
    anything is read, anything else (a pipe) by reading at most limit + 1 bytes, so a stray big (or sparse) file or
    a device is never read whole. OSError where it cannot be opened."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size > limit:
            return None
        raw = f.read(limit + 1)
    return raw if len(raw) <= limit else None


def special_file(path: str | os.PathLike) -> str | None:
    """What `path` is ("a FIFO", "a socket", "a device") when it exists but is neither a regular file nor a
    directory, else None. Reading one waits for a writer forever (a FIFO, /dev/stdin) or never ends (/dev/zero), so
    readers refuse it by this name before they open it."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"


def not_a_file(path: str | os.PathLike) -> str:
    """What stands at `path`, which exists (lexists) and is no regular file: "a directory", special_file's name,
    or a link that leads nowhere."""
    if os.path.isdir(path):
        return "a directory"
    return special_file(path) or "a symbolic link to nothing (or a loop of links)"


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so the names created or renamed in it survive a crash (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)



class CheckpointError(ValueError):
    """A model file or run directory that cannot be used; the message names the file and the problem."""


def fault_delay_seconds() -> float:
    """LLMC_FAULT_CHECKPOINT_DELAY (a test hook) as seconds, 0 when unset; ValueError naming it otherwise (`llmc
    train` asks before it starts, so a bad value is one line then, not a failed checkpoint later)."""
    import math
    d = os.environ.get("LLMC_FAULT_CHECKPOINT_DELAY", "").strip()
    if not d:
        return 0.0
    try:
        s = float(d)
    except ValueError:
        s = math.nan
    if not (math.isfinite(s) and 0 <= s <= 3600):
        raise ValueError(f"LLMC_FAULT_CHECKPOINT_DELAY={d}: expected seconds in [0, 3600] (a test hook; unset it)")
    return s


def fault_delay(phase: str) -> None:
    """Test hook: LLMC_FAULT_CHECKPOINT_DELAY=seconds sleeps at each phase of a checkpoint write, so a test's
    SIGKILL lands inside one. Unset (always, outside tests): does nothing."""
    s = fault_delay_seconds()
    if s:
        import time
        time.sleep(s)


class DataError(ValueError):
    """Bad or missing data (shards, tokenizer files, source corpora). The message is one line and
    names the file and what was expected."""
