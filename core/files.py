"""Writing files so that a crash never corrupts what was there, and reading back what a crash left."""
from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["append_jsonl", "read_jsonl", "write_atomically", "write_text_atomically"]


def write_atomically(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Have `write` fill a temporary file beside `path`, then move it over `path` in one step.

    A crash mid-write leaves the old file (or none) in place, never a half-written one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    os.close(handle)
    try:
        write(Path(temporary))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def write_text_atomically(path: str | Path, text: str) -> Path:
    return write_atomically(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSONL file; an unfinished last line (a run killed mid-write) is skipped with a warning.

    Any other line that is not JSON raises ValueError naming the file and line.
    """
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").split("\n")
    unfinished = lines.pop()  # text after the last newline: empty unless a write was cut short
    records = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            records.append(_parse(path, number, line))
    if unfinished.strip():
        logger.warning("%s: ignoring an unfinished last line (a run stopped while writing it)", path)
    return records


def append_jsonl(path: str | Path, records: Iterable[dict[str, Any]]) -> None:
    """Append records as whole lines, first cutting off an unfinished last line left by a crash."""
    path = Path(path)
    text = "".join(json.dumps(record) + "\n" for record in records)
    with open(path, "ab") as handle:
        keep = _complete_length(path)
        if keep is not None:
            handle.truncate(keep)
        handle.write(text.encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())


def _complete_length(path: Path) -> int | None:
    """Bytes of `path` up to its last newline when it ends in an unfinished line; None when it does not."""
    with open(path, "rb") as reader:
        end = reader.seek(0, os.SEEK_END)
        if not end:
            return None
        reader.seek(end - 1)
        if reader.read(1) == b"\n":
            return None
        reader.seek(0)
        return reader.read().rfind(b"\n") + 1


def _parse(path: Path, number: int, line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}, line {number}: not a JSON record ({error.msg}); fix or remove that line") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}, line {number}: expected a JSON object, got {type(record).__name__}")
    return record
