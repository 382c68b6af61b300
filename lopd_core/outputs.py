"""Where a command writes: the one place that decides whether a path given as `--out` may be written.

Why a module of its own: every command that takes `--out` used to write its own way, and two of them destroyed
what the user had there (`lopd export --out ..` emptied the parent folder; `lopd evaluate --out` replaced a
symlink, a FIFO or a device node with a JSON file). The rules, the same for every command:

- a file output is written only over a regular file or a missing path, atomically (a temporary file beside it,
  then a rename: `atomic_write`, and `write_file` for content in hand); a symlink is followed, never replaced; a
  folder, a device, a FIFO or a socket is refused;
- a folder output is written only into a missing or empty folder or one that a previous run of the same command
  wrote (recognised by a marker file it leaves, or for folders written before the marker existed by holding
  nothing but the command's own file names); anything else is refused, naming the folder;
- a folder that is replaced as a whole (an export) is built in a fresh staging folder beside it and swapped in
  only once complete;
- what cannot be written (no space left, a read-only folder, no permission) is one line naming the path, and no
  half-written temporary is left behind.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from lopd_core.errors import StateError


class OutputPathError(StateError):
    """An output path that must not be written as it is; the message names it and what to do."""


def _reason(exc: OSError | None) -> str:
    if exc is None:
        return "unknown cause"
    if exc.errno == errno.ENOSPC:
        return "no space left on the device"
    if exc.errno in (errno.EROFS,):
        return "the file system is read-only"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return exc.strerror or str(exc)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def file_target(path: str | Path) -> Path:
    """The regular file that writing to `path` would replace (a symlink followed to its target), or a missing
    path; anything else raises OutputPathError naming `path`."""
    given = Path(path)
    if not str(path).strip():
        raise OutputPathError("refusing to write to an empty path (name a file)")
    try:
        target = given.resolve(strict=False) if given.is_symlink() else given
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    except RuntimeError as exc:  # a symlink loop, as pathlib reports it
        raise OutputPathError(f"cannot write {given}: {exc}") from exc
    except OSError as exc:
        raise OutputPathError(f"cannot write {given}: {_reason(exc)}") from exc
    if str(path).endswith(os.sep) and mode is not None:
        raise OutputPathError(f"refusing to write {given}: the path ends with {os.sep!r} (name a file)")
    if mode is not None and not stat.S_ISREG(mode):
        raise OutputPathError(f"refusing to write {given}: it is {_kind(mode)}, not a regular file (name a file path)")
    return target


def outside_of(target: Path, folder: str | Path, what: str) -> Path:
    """`target` unless it lies inside `folder` (an input the command reads: `--out` into the model being
    evaluated would overwrite it); a folder that does not exist holds nothing."""
    inside = Path(folder)
    if str(folder) and inside.is_dir() and target.resolve().is_relative_to(inside.resolve()):
        raise OutputPathError(f"refusing to write {target}: it is inside {inside}, {what}")
    return target


@contextmanager
def atomic_write(path: str | Path, *, text: bool = False) -> Iterator[IO]:
    """A file object to write `path` through, under the rules above: it is a temporary file beside the target,
    flushed, synced and renamed over it when the block ends, removed when the block raises, so a reader (or a
    crash) never sees half a file. `text`: UTF-8 with no newline translation, else bytes. An OSError becomes one
    OutputPathError naming `path`."""
    target = file_target(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputPathError(f"cannot create the folder of {path}: {_reason(exc)}") from exc
    if not target.parent.is_dir():
        raise OutputPathError(f"cannot write {path}: {target.parent} is not a folder")
    tmp = None
    try:
        # a short temporary name: a target name at the file system's limit must still fit beside it
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".lopd-", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8", newline="") if text else os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        # mkstemp makes it 0600: a replaced file keeps its mode, a new one gets the umask's, as open() would
        os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode) if target.exists() else 0o666 & ~_umask())
        os.replace(tmp, target)
        tmp = None
    except OSError as exc:
        raise OutputPathError(f"cannot write {path}: {_reason(exc)}") from exc
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def write_file(path: str | Path, content: str | bytes) -> Path:
    """Write `content` to `path` atomically under the rules above; return the path written (a symlink's target)."""
    with atomic_write(path) as f:
        f.write(content.encode("utf-8") if isinstance(content, str) else content)
    return file_target(path)


def _umask() -> int:
    """The process's umask, read without setting it (os.umask would change it for every thread meanwhile)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0)  # no /proc (macOS): the only other way to read it
    os.umask(mask)
    return mask


def check_folder(
    path: str | Path, marker: str, what: str, legacy: Callable[[Path, set[str]], bool] | None = None
) -> Path:
    """`path` if a command may write into it: missing, empty, or one of ours — holding `marker`, or written before
    the marker existed as `legacy(folder, names)` recognises by content (a file name alone is not enough: a user's
    own Hugging Face folder has the same names as a base). Otherwise OutputPathError naming the folder."""
    folder = Path(path)
    try:
        target = folder.resolve()
    except (RuntimeError, OSError) as exc:
        raise OutputPathError(f"cannot write {what} to {folder}: {exc}") from exc
    if target.exists() and not target.is_dir():
        raise OutputPathError(f"refusing to write {what} to {folder}: it exists and is not a folder")
    if target.is_dir():
        try:
            names = {entry.name for entry in target.iterdir()}
        except OSError as exc:
            raise OutputPathError(f"cannot read {folder}: {_reason(exc)}") from exc
        if names and marker not in names and not (legacy is not None and legacy(target, names)):
            raise OutputPathError(
                f"refusing to write {what} into {folder}: it is not empty and not {what} written by lopd "
                f"(no {marker} marker); name a new or empty folder"
            )
    return target


def mark_folder(folder: Path, marker: str) -> None:
    """Leave the marker that lets a later run of the same command recognise the folder as its own."""
    (folder / marker).write_text("written by lopd; a later run may replace this folder's contents\n")


def publish_folder(
    path: str | Path,
    marker: str,
    what: str,
    fill: Callable[[Path], None],
    legacy: Callable[[Path, set[str]], bool] | None = None,
) -> Path:
    """Build a folder in a staging folder beside `path` with `fill(staging)`, then swap it in as `path`.

    Only a missing or empty folder, or one of ours, is replaced (check_folder); the previous one is removed only
    after the new one is in place, and a failure leaves `path` as it was."""
    target = check_folder(path, marker, what, legacy)
    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=parent, prefix=f".{target.name}.staging-"))
        # mkdtemp makes a private (0700) folder: the published one gets the previous folder's mode, else the
        # umask's, as a folder made by mkdir would
        os.chmod(staging, stat.S_IMODE(os.stat(target).st_mode) if target.is_dir() else 0o777 & ~_umask())
    except OSError as exc:
        raise OutputPathError(f"cannot write {what} to {path}: {_reason(exc)}") from exc
    old = None
    try:
        fill(staging)
        mark_folder(staging, marker)
        check_folder(path, marker, what, legacy)  # again: the folder may have changed while we wrote
        if target.exists():
            old = parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(target, old)
        try:
            os.rename(staging, target)
        except OSError:
            if old is not None:
                os.rename(old, target)
                old = None
            raise
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise OutputPathError(f"cannot write {what} to {path}: {_reason(exc)}") from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target
