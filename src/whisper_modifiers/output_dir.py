"""Writing a checkpoint directory safely: never over what this package did not write.

``whisper-prune`` writes into a hidden sibling of the target, ``.NAME.partial-XXXX``,
then renames it into place, so an interrupted run never leaves a directory that looks
complete.  This module holds the rules around that:

* ``check_output_dir`` (before any work): the target is new, empty, or a checkpoint a
  previous ``whisper-prune`` wrote (it holds ``whisper_prune_report.json``) and
  ``overwrite`` was given; never ``.``, ``~``, ``/``, nor a directory that is or
  contains a protected path (the source model, the calibration and evaluation files);
  its parent is a writable directory (or can be made one).
* ``partial_output``: the partial directory, locked (``flock``) by the writing process
  for its whole life, removed on any failure (SIGINT/SIGTERM included, see
  ``terminate_as_exception``); on success it replaces the target without a moment where
  neither the old nor the new checkpoint exists, and gets the umask's permissions.
* ``remove_stale_partials``: partial directories of the same name left by a killed run
  (older than this run, and no process holds their lock) are removed, and so is an old
  checkpoint moved aside (``.NAME.replaced-XXXX``) once the new one is in place.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from whisper_sparse.format.checkpoint import LOCK_FILE, PARTIAL_MARK, REPORT_FILE

__all__ = [
    "OutputDirError",
    "check_output_dir",
    "partial_output",
    "remove_stale_partials",
    "terminate_as_exception",
]

_ASIDE = ".replaced-"


class OutputDirError(ValueError):
    """The output directory cannot be used; raised before any work."""


def _contains(directory: Path, path: Path) -> bool:
    return path == directory or directory in path.parents


def _describe(entries: list[Path], limit: int = 6) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in entries)
    more = f", … ({len(names)} entries)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_output_dir(
    target: str | Path,
    protected: Iterable[str | Path] = (),
    overwrite: bool = False,
    flag: str = "--output-dir",
    marker: str = REPORT_FILE,
    program: str = "whisper-prune",
    output: str = "a whisper-prune checkpoint",
) -> Path:
    """Raise ``OutputDirError`` unless ``target`` may receive a new output of ``program``
    (a checkpoint of whisper-prune, a report of whisper-diagnose).

    :param protected: paths that must survive (source model directory, data files);
        ``target`` may be none of them and contain none of them.
    :param overwrite: allow replacing an output that ``program`` wrote (it holds
        ``marker``).
    :param flag: the command-line flag that named ``target``, and ``output`` what
        ``program`` writes there, for the messages.
    :return: ``target``, resolved.
    """
    given = target
    try:
        target = Path(target).expanduser().resolve()
    except (OSError, RuntimeError) as error:  # a symlink loop
        raise OutputDirError(f"{flag} {str(given)!r} cannot be resolved: {error}") from error
    refused = {Path("/"), Path.home().resolve(), Path.cwd().resolve()}
    if target in refused:
        raise OutputDirError(
            f"{flag} {str(given)!r} is {target}, the filesystem root, your home or the "
            f"current directory; {program} never writes there: name a new directory, "
            "e.g. outputs/my-model"
        )
    for path in protected:
        path = Path(path).expanduser().resolve()
        if _contains(target, path):
            what = "is" if path == target else "contains"
            raise OutputDirError(
                f"{flag} {target} {what} {path}, an input of this run; replacing it "
                "would destroy that input: choose another directory"
            )
    if target.exists() or target.is_symlink():
        _check_replaceable(target, overwrite, flag, marker, program, output)
    _check_writable(target, flag)
    return target


def _check_replaceable(target: Path, overwrite, flag, marker, program, output) -> None:
    """An existing ``target`` may be reused if empty, or replaced with ``overwrite`` if
    ``program`` wrote it (``check_output_dir``'s parameters)."""
    if not target.is_dir():
        raise OutputDirError(f"{flag} {target} exists and is not a directory")
    entries = list(target.iterdir())
    if entries and not (target / marker).is_file():
        even = ", even with --overwrite" if flag.startswith("--") else ""
        raise OutputDirError(
            f"{flag} {target} is not empty and was not written by {program} "
            f"(it holds {_describe(entries)}); it is never replaced{even}: choose a new or "
            "empty directory"
        )
    if entries and not overwrite:
        raise OutputDirError(
            f"{flag} {target} already holds {output}; choose another directory or pass "
            "--overwrite to replace it"
        )


def _check_writable(target: Path, flag: str) -> None:
    """The nearest existing ancestor of ``target`` is a directory we may write in."""
    ancestor = target.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputDirError(f"{flag} {target} lies under {ancestor}, which is a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputDirError(f"{flag} {target}: cannot write in {ancestor} (permission denied)")


def _lock_is_free(directory: Path) -> bool:
    lock = directory / LOCK_FILE
    if not lock.exists():
        return True
    with open(lock, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


def remove_stale_partials(target: str | Path, started: float | None = None) -> list[Path]:
    """Remove ``.NAME.partial-*`` directories beside ``target`` that a killed run left:
    modified before ``started`` (default: now) and not locked by a live process.
    Returns what was removed."""
    target = Path(target)
    started = time.time() if started is None else started
    removed = []
    if not target.parent.is_dir():
        return removed
    candidates = list(target.parent.glob(f".{target.name}{PARTIAL_MARK}*"))
    if (target / REPORT_FILE).is_file():  # the new checkpoint is in place: the old is waste
        candidates += target.parent.glob(f".{target.name}{_ASIDE}*")
    for candidate in candidates:
        if candidate.is_dir() and not candidate.is_symlink():
            if candidate.stat().st_mtime < started and _lock_is_free(candidate):
                shutil.rmtree(candidate, ignore_errors=True)
                removed.append(candidate)
    return removed


def _apply_umask(directory: Path) -> None:
    """``mkdtemp`` makes 0700 directories: give the tree the modes the umask gives any
    newly created file (a serving account must be able to read the checkpoint)."""
    umask = os.umask(0)
    os.umask(umask)
    for root, _dirs, files in os.walk(directory):
        os.chmod(root, 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)


@contextlib.contextmanager
def partial_output(target: str | Path) -> Iterator[Path]:
    """A locked partial directory beside ``target`` to write into; on normal exit it
    replaces ``target`` (the old one is moved aside, the new one renamed into place, then
    the old one deleted), on any exception it is removed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}{PARTIAL_MARK}", dir=target.parent))
    lock = open(partial / LOCK_FILE, "w")
    aside = None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield partial
        _apply_umask(partial)
        if target.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{target.name}{_ASIDE}", dir=target.parent))
            os.replace(target, aside / target.name)
        try:
            os.replace(partial, target)
        except BaseException:
            if aside is not None:  # put the old checkpoint back
                os.replace(aside / target.name, target)
            raise
        (target / LOCK_FILE).unlink()
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        if aside is not None and aside.is_dir() and not any(aside.iterdir()):
            aside.rmdir()
        raise
    finally:
        lock.close()


@contextlib.contextmanager
def terminate_as_exception() -> Iterator[None]:
    """Inside, SIGTERM raises ``SystemExit(143)`` like Ctrl-C raises
    ``KeyboardInterrupt``, so ``finally`` blocks (``partial_output``'s clean-up) run."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
