"""A checkpoint directory replaced whole or not at all: a save is written beside it, then swapped in.

DCP writes each rank's data file in place (opened for writing, so emptied first) and the metadata
last. A save into the directory of an earlier checkpoint (any loop that keeps one "latest"
checkpoint) that is stopped part way (a preemption, a node lost, Ctrl-C) would destroy the earlier
checkpoint with nothing whole in its place: a later ``load`` either fails on a cut file or, worse,
reads a mix of ranks' files from two different steps without an error.

So ``zcompile.checkpoint.save`` writes into ``<path>.zcompile-saving`` and, once DCP has written every
rank's files and the metadata, the coordinating rank swaps it in: ``<path>`` to ``<path>.zcompile-old``,
the new one to ``<path>``, the old one removed. Stopped at any point, a complete checkpoint is left:
``<path>`` until the swap, ``<path>.zcompile-saving`` (complete: its metadata is written) between the
swap's two renames, which ``readable_checkpoint`` finds and ``load`` reads with a warning, and the
next save moves into place before it starts. A path with a scheme (``s3://``) is written in place, as
DCP writes it. The directory is on a filesystem every rank shares, as DCP's loads need (each rank
reads other ranks' files when it reshards).
"""

from __future__ import annotations

import logging
import os
import re
import shutil

from zcompile.agreement.fixes import SAVE_DECISION_FIX
from zcompile.agreement.store_exchange import exchange_on_store
from zcompile.checkpoint.checksums import digests_of, own_data_files, write_record
from zcompile.checkpoint.layout import CheckpointError, agree_on_call
from zcompile.common.process_group import DataParallelGroup

log = logging.getLogger(__name__)

STAGING_SUFFIX = ".zcompile-saving"
PREVIOUS_SUFFIX = ".zcompile-old"
_METADATA_FILE = ".metadata"  # DCP's, renamed into place last when a save finishes
# what a save puts in a checkpoint directory: DCP's metadata (global, or per rank without collectives),
# its temporary name while written, the ranks' data files, and zcompile's checksum record (``checksums``)
_DCP_FILE = re.compile(r"(__\d+)?\.metadata(\.tmp)?|__\d+_\d+\.distcp|zcompile-checksums\.json(\.tmp)?")


def replaced_whole(path: str) -> bool:
    """Whether a save of ``path`` goes through a staging directory (a local path: os.rename applies)."""
    return "://" not in path


def staging_dir(path: str) -> str:
    return os.path.normpath(path) + STAGING_SUFFIX


def previous_dir(path: str) -> str:
    return os.path.normpath(path) + PREVIOUS_SUFFIX


def is_complete(directory: str) -> bool:
    """Whether DCP finished a save into ``directory`` (its metadata is the last thing written)."""
    return os.path.isfile(os.path.join(directory, _METADATA_FILE))


def prepare_save(path: str) -> None:
    """The coordinator's clean-up before a save of ``path`` (into ``staging_dir(path)``).
    ``CheckpointError`` when ``path`` holds anything but a checkpoint (a file, a run's logs): the swap
    would delete it.

    A save stopped between the swap's renames left the new checkpoint complete in the staging
    directory and none at ``path``: it is moved into place first. Then whatever an earlier stopped
    save left beside ``path`` (a staging directory without metadata, an old one not yet removed) goes."""
    foreign = foreign_files(path)
    if foreign:  # the swap replaces the whole directory: never someone's other files with it
        raise CheckpointError(
            f"{path} holds what no checkpoint holds ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}), which replacing it would delete: save into a "
            "directory of its own"
        )
    staging, previous = staging_dir(path), previous_dir(path)
    if not is_complete(path) and is_complete(staging):
        remove_directory(path)
        os.rename(staging, path)
        log.warning(
            "zcompile.checkpoint.save: %s was saved whole but not moved into place (a save stopped while it "
            "swapped them); moved now",
            staging,
        )
    remove_directory(staging)
    remove_directory(previous)


def foreign_files(path: str) -> list[str]:
    """What ``path`` holds that DCP does not write (``[path]`` itself when it is a file): empty for a
    checkpoint directory, an empty one, or none."""
    if not os.path.lexists(path):
        return []
    if not os.path.isdir(path) or os.path.islink(path):
        return [path]
    return sorted(name for name in os.listdir(path) if not _DCP_FILE.fullmatch(name))


def commit_save(path: str) -> None:
    """The coordinator, once DCP has written the whole checkpoint into ``staging_dir(path)``: moves it to
    ``path``, replacing the checkpoint there."""
    staging, previous = staging_dir(path), previous_dir(path)
    if not is_complete(staging):  # DCP returned without its metadata: never swap in a partial save
        raise RuntimeError(f"the save into {staging} has no {_METADATA_FILE}")  # the caller says what is kept
    if os.path.lexists(path):
        os.rename(path, previous)
    os.rename(staging, path)
    remove_directory(previous)


def readable_checkpoint(path: str) -> str:
    """The directory ``load`` reads for ``path``: ``path``, or its staging directory when a save was
    stopped between the swap's two renames (``path`` gone or incomplete, the staging one complete)."""
    if not replaced_whole(path) or is_complete(path):
        return path
    staging = staging_dir(path)
    if is_complete(staging):
        log.warning(
            "zcompile.checkpoint: %s is not a complete checkpoint and %s is (a save stopped while it swapped "
            "them in); reading %s",
            path,
            staging,
            staging,
        )
        return staging
    return path


def leftovers(parent: str) -> list[tuple[str, str]]:
    """What stopped saves left in directory ``parent`` (one level): ``(directory, what it is)`` for each
    staging directory that is not a checkpoint to read and each replaced checkpoint not yet removed. A
    save cleans only beside its own path, so with a directory per save (``ck/step0040``, ``ck/step0050``)
    these stay. A complete staging directory is never listed: a finished save, which ``load`` reads
    when its path is missing or incomplete and the next save of that path moves into place."""
    found = []
    for name in sorted(os.listdir(parent)):
        directory = os.path.join(parent, name)
        if not os.path.isdir(directory) or os.path.islink(directory):
            continue
        if name.endswith(STAGING_SUFFIX):
            if not is_complete(directory):
                found.append((directory, "a save stopped before it finished (no metadata)"))
        elif name.endswith(PREVIOUS_SUFFIX):
            found.append((directory, "a replaced checkpoint a swap did not remove"))
    return found


def incomplete_save_note(path: str) -> str:
    """A sentence for a load of ``path`` that failed: what a stopped save left beside it, if anything."""
    if replaced_whole(path) and os.path.isdir(staging_dir(path)) and not is_complete(staging_dir(path)):
        return (
            f" A save into {staging_dir(path)} was stopped before it finished (no {_METADATA_FILE}); "
            "it is not a checkpoint, and the next save removes it."
        )
    return ""


def remove_directory(directory: str) -> None:
    if os.path.isdir(directory) and not os.path.islink(directory):
        shutil.rmtree(directory)
    elif os.path.lexists(directory):
        os.remove(directory)


def swap_in_written_save(
    path: str, group: DataParallelGroup, timeout_s: float, problem: str | None = None, checksums: bool = True
) -> None:
    """The written save swapped in at ``path`` by the coordinating rank, with the checksum record of
    every rank's files (``checksums``); every rank returns once it is (or raises, on every rank, when
    writing, hashing or the swap failed on any)."""
    # counted apart from the training thread's checkpoint calls, per path: a background save swaps on
    # DCP's thread, and two models' background saves may finish in another order on each rank
    purpose = f"checkpoint-swap:{os.path.abspath(path)}"
    staging, digests = staging_dir(path), {}
    if problem is None and checksums:
        try:
            digests = digests_of(staging, own_data_files(staging, group.rank))
        except OSError as error:
            problem = f"hashing the files it wrote failed ({error})"
    everyone = exchange_on_store(
        {"failed": problem is not None, "digests": digests},
        group,
        timeout_s,
        purpose,
        "zcompile.checkpoint.save",
        SAVE_DECISION_FIX,
    )
    if group.rank == 0 and not any(entry["failed"] for entry in everyone):
        try:
            if checksums:
                write_record(staging, {name: d for entry in everyone for name, d in entry["digests"].items()})
            commit_save(path)
        except (OSError, RuntimeError) as error:
            problem = f"moving the finished save into place failed ({error}); {path} is left as it was"
    agree_on_call("save", path, group, timeout_s, problem, purpose=purpose)
