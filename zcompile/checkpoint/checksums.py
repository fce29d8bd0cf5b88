"""Checksums of every file a save writes, so a load never reads silently damaged bytes.

DCP records where each tensor lies in the ranks' data files, not what the bytes were: a few bytes
overwritten inside a data file (a bad disk, a copy gone wrong) load without an error, as wrong
weights or optimizer state. So each rank hashes the data files it wrote once DCP has written them,
the coordinating rank adds the hash of DCP's ``.metadata`` and writes them all to ``RECORD_FILE``
in the checkpoint directory before the save is swapped in (``commit``); ``load`` and ``consolidate``
compare every file against it before reading a tensor.

SHA-256 from ``hashlib``: in every Python, hardware-accelerated on current x86 and Arm CPUs, and the
digest model hubs publish. A checkpoint without a record (saved with ``checksums=False``, or by an
older zcompile) is read unverified.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable

RECORD_FILE = "zcompile-checksums.json"
ALGORITHM = "sha256"
_METADATA_FILE = ".metadata"
_CHUNK_BYTES = 1 << 20


def file_digest(file: str) -> dict:
    """``{"bytes": size, "sha256": hex digest}`` of ``file``, read in chunks into one reused buffer."""
    digest = hashlib.new(ALGORITHM)
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    size = 0
    with open(file, "rb", buffering=0) as stream:
        while read := stream.readinto(buffer):
            digest.update(view[:read])  # hashlib releases the GIL on large updates
            size += read
    return {"bytes": size, ALGORITHM: digest.hexdigest()}


def own_data_files(directory: str, rank: int) -> list[str]:
    """The data files rank ``rank`` wrote into ``directory`` (DCP names them ``__{rank}_{n}.distcp``)."""
    mine = re.compile(rf"__{rank}_\d+\.distcp")
    return sorted(name for name in os.listdir(directory) if mine.fullmatch(name))


def digests_of(directory: str, names: list[str]) -> dict[str, dict]:
    return {name: file_digest(os.path.join(directory, name)) for name in names}


def write_record(directory: str, data_files: dict[str, dict]) -> None:
    """The coordinator, after DCP's metadata is written: ``data_files`` (every rank's digests) and the
    metadata's own, to ``RECORD_FILE`` (written to a temporary name, then renamed: never half a record)."""
    files = dict(sorted(data_files.items())) | {_METADATA_FILE: file_digest(os.path.join(directory, _METADATA_FILE))}
    record = os.path.join(directory, RECORD_FILE)
    with open(record + ".tmp", "w") as stream:
        json.dump({"algorithm": ALGORITHM, "files": files}, stream, indent=1)
    os.replace(record + ".tmp", record)


def read_record(directory: str) -> dict[str, dict] | None:
    """The recorded ``{file: digest}`` of checkpoint ``directory``, or None where it has no record;
    ``ValueError`` when the record itself is damaged."""
    record = os.path.join(directory, RECORD_FILE)
    if not os.path.isfile(record):
        return None
    try:
        with open(record) as stream:
            content = json.load(stream)
        if content["algorithm"] != ALGORITHM:
            raise ValueError(f"algorithm {content['algorithm']!r}, expected {ALGORITHM!r}")
        return dict(content["files"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{record} is damaged ({type(error).__name__}: {error})") from error


def share_of(files: list[str], rank: int, world_size: int) -> list[str]:
    """The files rank ``rank`` verifies on a load of ``world_size`` ranks: every ``world_size``-th data
    file of the sorted list, so each is read once and the ranks read in parallel, and the metadata
    (small) on every rank, so each rank finds a damaged one before it reads it."""
    data = sorted(name for name in files if name != _METADATA_FILE)
    return [name for name in files if name == _METADATA_FILE] + data[rank::world_size]


def mismatches(directory: str, recorded: dict[str, dict], names: list[str]) -> list[str]:
    """For each of ``names`` (files of checkpoint ``directory``) that is missing or does not match its
    ``recorded`` digest, ``"file: why"``; empty when all match."""
    found = []
    for name in names:
        file, expected = _described(directory, name), recorded[name]
        if not os.path.isfile(os.path.join(directory, name)):
            found.append(f"{file}: missing")
            continue
        actual = file_digest(os.path.join(directory, name))
        if actual["bytes"] != expected["bytes"]:
            found.append(f"{file}: {actual['bytes']:,} bytes, saved with {expected['bytes']:,}")
        elif actual[ALGORITHM] != expected[ALGORITHM]:
            found.append(f"{file}: its bytes changed since the save ({ALGORITHM} differs)")
    return found


def unrecorded(directory: str, recorded: dict[str, dict], metadata_files: set[str]) -> list[str]:
    """Data files the metadata names that the record lacks (``"file: why"``): a file swapped in from
    another save would otherwise go unchecked."""
    return [f"{_described(directory, name)}: not in {RECORD_FILE}" for name in sorted(metadata_files - set(recorded))]


def _described(directory: str, name: str) -> str:
    """A file of the checkpoint with the rank that wrote it (DCP's ``__{rank}_{n}.distcp``)."""
    match = re.fullmatch(r"__(\d+)_\d+\.distcp", name)
    file = os.path.join(directory, name)
    return f"{file} (written by rank {match.group(1)})" if match else file


def damage(
    directory: str,
    read_ends: Callable[[], dict[str, int]],
    rank: int = 0,
    world_size: int = 1,
    verify: bool = True,
) -> list[str]:
    """What is wrong with the files of checkpoint ``directory`` (``"file: why"`` each; empty: nothing),
    as far as rank ``rank`` of ``world_size`` checks: its share of the recorded files against their
    digests, then on rank 0 the data files the metadata names that the record lacks. Without a record
    (or with ``verify`` False), the data files' sizes only: DCP reads what a cut file still holds
    without a word when the cut is past the pieces a read asks for. ``read_ends``: each data file
    the metadata names -> its least size (``data_file_ends``), called once the record is verified, so
    that a damaged metadata is named as such rather than failing to unpickle."""
    recorded = None
    if verify:
        try:
            recorded = read_record(directory)
        except ValueError as error:
            return [str(error)]
    if recorded is None:
        return [] if rank else _short_files(directory, read_ends())
    if found := mismatches(directory, recorded, share_of(list(recorded), rank, world_size)):
        return found
    return unrecorded(directory, recorded, set(read_ends())) if rank == 0 else []


def _short_files(directory: str, data_file_ends: dict[str, int]) -> list[str]:
    damaged = []
    for name, end in sorted(data_file_ends.items()):
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            damaged.append(f"{_described(directory, name)}: missing")
        elif (size := os.path.getsize(file)) < end:
            damaged.append(f"{_described(directory, name)}: {size:,} bytes, the metadata needs {end:,}")
    return damaged


def data_file_ends(metadata) -> dict[str, int]:
    """Each data file DCP's ``metadata`` names -> the end of its last piece (the least size it can have)."""
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    return ends
