"""Readers of the kernel's sysfs and procfs files, one function per kind of file.

Every reader takes the file's full path (under whatever root a snapshot lives in),
returns None when the file is missing, and on damage (NUL bytes, an empty file,
text that does not parse) warns with :class:`TopologyWarning` and returns what
it could read: a topology that is partly known beats a crash in a launcher.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path

from numafast._validate import ID_LIMIT, format_ids, parse_ids
from numafast.errors import TopologyWarning
from numafast.private import stacklevel_outside

# One word of the kernel's hex mask format: up to 32 bits, in hex.
MASK_WORD = re.compile(r"[0-9a-fA-F]{1,8}")


def warn(message: str) -> None:
    """Report damage in the files a topology was read from, at the caller's line outside numafast."""
    warnings.warn(message, TopologyWarning, stacklevel=stacklevel_outside())


def read_text(path: Path) -> str | None:
    """The file's text without surrounding whitespace; None if it is missing or unreadable.

    Real sysfs files end in a newline, so a file of zero bytes is a truncated copy.
    Some firmware-backed attributes end in NUL bytes: the text before the first NUL
    is kept.
    """
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        warn(f"{path}: unreadable ({error.strerror}); treated as missing")
        return None
    if not data:
        warn(f"{path}: empty file; treated as holding nothing")
        return ""
    if b"\x00" in data:
        warn(f"{path}: contains NUL bytes; reading only what precedes the first one")
        data = data.split(b"\x00", 1)[0]
    return data.decode("utf-8", errors="replace").strip()


def read_int(path: Path, *, base: int = 10) -> int | None:
    """A file holding one integer ('0\\n', '-1\\n', or '0x10de\\n' with base=16)."""
    text = read_text(path)
    if not text:
        return None
    try:
        return int(text, base)
    except ValueError:
        warn(f"{path}: {text[:40]!r} is not an integer; treated as unknown")
        return None


def read_id_list(path: Path) -> list[int] | None:
    """A kernel list file (cpulist, nodelist, shared_cpu_list: '0-3,8'); None if missing."""
    text = read_text(path)
    if text is None:
        return None
    try:
        return sorted(set(parse_ids(text)))
    except ValueError:
        warn(f"{path}: {text[:40]!r} is not a list of ids; treated as empty")
        return []


def parse_mask(text: str) -> list[int]:
    """'000f,ff000fff' -> [0, ..., 11, 24, ..., 35]: the ids whose bits a kernel mask sets.

    The kernel's mask files (a node's ``cpumap``, ``thread_siblings``, a cache's
    ``shared_cpu_map``, a PCI device's ``local_cpus``, ``Cpus_allowed`` in
    ``/proc/PID/status``) print the bitmap as comma-separated 32-bit words in hex,
    most significant first; as many words as the bitmap's width needs (nr_cpu_ids
    or MAX_NUMNODES bits), the first one only as wide as its bits ('ff' on an
    8-CPU kernel, '0000,00000fff' on a 48-CPU one). ValueError for anything else,
    and for a mask wider than :data:`~numafast._validate.ID_LIMIT` bits.
    """
    text = text.strip().strip("\x00")
    words = text.split(",") if text else []
    if len(words) * 32 > ID_LIMIT:
        raise ValueError(f"a mask of {len(words)} words is wider than any kernel's (at most {ID_LIMIT} bits)")
    ids: list[int] = []
    for position, word in enumerate(reversed(words)):  # least significant first: ids come out sorted
        if not MASK_WORD.fullmatch(word.strip()):
            raise ValueError(f"{word!r} is not a 32-bit hex word")
        bits = int(word, 16)
        ids.extend(32 * position + bit for bit in range(bits.bit_length()) if bits >> bit & 1)
    return ids


def id_set(list_text: str | None, mask_text: str | None, list_source: str, mask_source: str) -> list[int] | None:
    """A set of CPUs (or nodes) the kernel writes in two forms: a list ('0-11,24-35') and
    a hex mask ('000f,ff000fff'); None when neither is there (or parses).

    Kernels write both, but archived snapshots, older and vendor kernels may keep only
    the mask: then it is read. Where both parse and disagree (a snapshot taken
    across a CPU hotplug, a hand-edited copy), the list wins, with a warning.
    ``*_source`` name each form in messages (a path, or a field of a file).
    """
    listed = _parsed(list_text, parse_ids, list_source, "a list of ids")
    masked = _parsed(mask_text, parse_mask, mask_source, "a hex mask")
    if listed is None:
        return masked
    if masked is not None and set(masked) != set(listed):
        warn(
            f"{list_source} says {format_ids(listed)} but {mask_source} says {format_ids(masked)}; "
            "taking the list"
        )
    return sorted(set(listed))


def read_id_set(list_path: Path, mask_path: Path) -> list[int] | None:
    """:func:`id_set` of two sysfs files (``cpulist`` and ``cpumap``, ``thread_siblings_list``
    and ``thread_siblings``...); None when both are missing.

    The running kernel's own /sys prints both forms from one bitmap, so there the
    mask is read only when the list is missing (a cold topology() reads no file twice).
    """
    list_text = read_text(list_path)
    if list_text is not None and list_path.parts[:2] == ("/", "sys"):
        return id_set(list_text, None, str(list_path), mask_path.name)
    return id_set(list_text, read_text(mask_path), str(list_path), mask_path.name)


def _parsed(text: str | None, parse: Callable[[str], list[int]], source: str, form: str) -> list[int] | None:
    """``parse(text)``; None when the text is missing, or does not parse (with a warning)."""
    if text is None:
        return None
    try:
        return parse(text)
    except ValueError:
        warn(f"{source}: {text[:40]!r} is not {form}; ignored")
        return None


def read_int_row(path: Path) -> list[int] | None:
    """A file of space-separated integers: a node's ``distance`` row ('10 21 21 10')."""
    text = read_text(path)
    if text is None:
        return None
    try:
        return [int(word) for word in text.split()]
    except ValueError:
        warn(f"{path}: {text[:40]!r} is not a row of integers; treated as missing")
        return None


def read_meminfo(path: Path) -> dict[str, int] | None:
    """A meminfo file as bytes per field.

    Reads both a node's ``meminfo`` ('Node 0 MemTotal:  4810956 kB') and
    ``/proc/meminfo`` ('MemTotal:  4810956 kB').
    """
    fields = read_fields(path)
    if fields is None:
        return None
    sizes: dict[str, int] = {}
    for name, value in fields.items():
        words = value.split()
        if name and words and words[0].isdecimal():
            sizes[name.split()[-1]] = int(words[0]) * (1024 if words[-1] == "kB" else 1)
    if "MemTotal" not in sizes:
        warn(f"{path}: no MemTotal field; memory treated as unknown")
    return sizes


def read_fields(path: Path) -> dict[str, str] | None:
    """A 'Name: value' file as a dict: ``/proc/PID/status`` ('Cpus_allowed_list' -> '0-3'),
    NVIDIA's ``/proc/driver/nvidia/gpus/ADDR/information`` ('GPU UUID' -> 'GPU-...')."""
    text = read_text(path)
    if text is None:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep:
            fields[name.strip()] = value.strip()
    return fields


def read_lines(path: Path) -> list[str] | None:
    """A file's lines (``/proc/mounts``, ``/proc/self/cgroup``)."""
    text = read_text(path)
    return None if text is None else text.splitlines()


def subdirs(path: Path, prefix: str) -> list[tuple[int, Path]]:
    """(number, path) of the entries ``prefixN`` of a directory (node3, cpu12, index2), by number."""
    try:
        entries = list(path.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    numbered = [
        (int(entry.name[len(prefix) :]), entry)
        for entry in entries
        if entry.name.startswith(prefix) and entry.name[len(prefix) :].isdecimal()
    ]
    return sorted(numbered)
