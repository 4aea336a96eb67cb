"""What ``numafast bench`` measured: :class:`BenchResult`, its matrices, and their JSON
form, schema ``numafast.bench/1``.

The JSON document (``numafast bench --json``, ``BenchResult.to_json()``)::

    {
      "schema": "numafast.bench/1",
      "version": "0.1.0",                 # numafast's
      "created": "2026-01-31T12:00:00Z",  # UTC, when the run started
      "settings": {
        "nodes": [0, 1],                  # the nodes the matrices cover
        "size": 134217728,                # bytes of each buffer
        "threads": null,                  # --threads: at most this many per cell; null = all allowed CPUs
        "repetitions": null,              # --repetitions; null = each matrix's default
        "quick": false,                   # --quick: small buffers, few repetitions
        "copy_by": "destination"          # node_copy_gbps: whose CPUs copy
      },
      "machine": {
        "hostname": "...", "kernel": "6.1.0-...", "cpu_model": "...",
        "page_size": 4096, "thp": "madvise", "thp_size": 2097152,  # thp_size 0: none
        "allowed_cpus": [0, 1], "allowed_nodes": [0, 1],
        "nodes": [{"id": 0, "cpus": [0], "memory_bytes": 1073741824,
                   "llc_bytes": 33554432}],  # LLC: the node's distinct last-level caches; null = unknown
        "distances": [[10, 20], [20, 10]],   # SLIT, rows and columns in "nodes" order
        "gpus": [{"index": 0, "address": "0000:3b:00.0", "node": 0}]
      },
      "matrices": {NAME: {
        "unit": "GB/s",                   # or "ns"
        "better": "higher",               # or "lower"
        "description": "...",
        "row_kind": "cpu_node",           # see ROW_AND_COLUMN_KINDS
        "rows": [0, 1],
        "col_kind": "memory_node",
        "cols": [0, 1],
        "values": [[17.2, 9.8], [null, 16.9]],  # values[i][j]: row i, column j; null = missing
        "missing": {"1,0": "why"},        # "ROW,COL" (ids, not indices) for every null value
        "threads": [[2, 2], [0, 2]],      # threads that did each cell's work (0 where missing)
        "bytes": 134217728,               # bytes of each buffer
        "repetitions": 10,                # timed repetitions per cell ...
        "warmup": 1,                      # ... after this many untimed ones
        "statistic": "best",              # which repetition a value comes from: "best" or "median"
        "per_repetition": 268435456,      # what one repetition counts ...
        "per_repetition_unit": "bytes",   # ... "bytes" (GB/s = 1e9 bytes/s) or "loads" (latency)
        "placement": {"0,1": {            # the kernel's answers, checked before the cell was kept
          "cpus": [0],                    # the CPUs the threads ran on (sched_getcpu, from inside them)
          "cpu_node": 0,                  # the node those CPUs belong to
          "buffers": {"source": {"node": 1, "pages": {"1": 32768}}}  # move_pages(2), base pages
        }}
      }}
    }

Matrices (NAME), as :data:`MATRICES` describes them: ``latency_ns``,
``read_gbps``, ``copy_gbps``, ``node_copy_gbps``, and with a usable CUDA device
``h2d_gbps`` / ``d2h_gbps`` and ``h2d_concurrent_gbps`` / ``d2h_concurrent_gbps``
(rows: the node of a page-locked, CUDA-registered host buffer; columns: CUDA
devices; bytes counted once per copy, as nvbandwidth counts them; the median of
the repetitions; ``"streams"`` gives the number of concurrent CUDA streams that
share each copy: 1, or 4 for the concurrent ones; ``placement`` gives the
``cuda_device`` and the kernel's count of the host buffer's pages). A run
measures a subset; every null value has its reason in ``missing``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

SCHEMA = "numafast.bench/1"
# The values a document's settings may hold (and the options may give: the command's
# parser reads them here, without importing what measures).
COPY_BY = ("destination", "source")
MAX_REPETITIONS = 10_000  # per cell: more is hours of a run, not a better median


@dataclass(frozen=True)
class MatrixKind:
    """What one matrix name means: its unit, axes and what counts as better."""

    unit: str
    better: str
    row_kind: str
    col_kind: str
    description: str


MATRICES: dict[str, MatrixKind] = {
    "latency_ns": MatrixKind(
        "ns", "lower", "cpu_node", "memory_node",
        "idle latency: ns per dependent load of a random pointer chase over a buffer several times the LLC, "
        "one thread on a CPU of the row node, memory on the column node",
    ),
    "read_gbps": MatrixKind(
        "GB/s", "higher", "cpu_node", "memory_node",
        "read bandwidth: each byte of the buffer on the column node read once, by threads on the row node's CPUs",
    ),
    "copy_gbps": MatrixKind(
        "GB/s", "higher", "cpu_node", "memory_node",
        "STREAM copy (its loop over doubles, regular stores): both buffers on the column node, copied by "
        "threads on the row node's CPUs; bytes read plus bytes written, as STREAM counts them",
    ),
    "node_copy_gbps": MatrixKind(
        "GB/s", "higher", "source_node", "destination_node",
        "memcpy() from a buffer on the row node to one on the column node (the copy a loader's pin step "
        "makes), by the CPUs of the destination (or the source: settings.copy_by); bytes read plus bytes "
        "written, as STREAM counts a copy",
    ),
    "h2d_gbps": MatrixKind(
        "GB/s", "higher", "memory_node", "cuda_device",
        "host-to-device copies from a page-locked buffer on the row node to the column's CUDA device",
    ),
    "d2h_gbps": MatrixKind(
        "GB/s", "higher", "memory_node", "cuda_device",
        "device-to-host copies from the column's CUDA device to a page-locked buffer on the row node",
    ),
    "h2d_concurrent_gbps": MatrixKind(
        "GB/s", "higher", "memory_node", "cuda_device",
        "host-to-device copies as h2d_gbps, the buffer cut into shares copied on concurrent CUDA streams",
    ),
    "d2h_concurrent_gbps": MatrixKind(
        "GB/s", "higher", "memory_node", "cuda_device",
        "device-to-host copies as d2h_gbps, the buffer cut into shares copied on concurrent CUDA streams",
    ),
}  # fmt: skip

ROW_AND_COLUMN_KINDS = {
    "cpu_node": "the node whose CPUs run the threads",
    "memory_node": "the node whose memory holds the buffer",
    "source_node": "the node of the buffer copied from",
    "destination_node": "the node of the buffer copied to",
    "cuda_device": "a CUDA device index, as this process numbers them",
}
NODE_KINDS = ("cpu_node", "memory_node", "source_node", "destination_node")
STATISTICS = ("best", "median")
PER_REPETITION_UNITS = ("bytes", "loads")


def cell_key(row: int, col: int) -> str:
    """The key of a cell in ``missing`` and ``placement``: "ROW,COL" (ids)."""
    return f"{row},{col}"


@dataclass
class Matrix:
    """One matrix of a run: ``values[i][j]`` for ``rows[i]`` x ``cols[j]``, None where missing."""

    name: str
    rows: list[int]
    cols: list[int]
    values: list[list[float | None]]
    missing: dict[str, str]
    threads: list[list[int]]
    bytes: int
    repetitions: int
    warmup: int
    statistic: str
    per_repetition: int
    per_repetition_unit: str
    placement: dict[str, dict[str, Any]] = field(default_factory=dict)
    streams: int | None = None

    @property
    def kind(self) -> MatrixKind:
        return MATRICES[self.name]

    @property
    def unit(self) -> str:
        return self.kind.unit

    def value(self, row: int, col: int) -> float | None:
        """The value of the cell (row id, column id); None where missing. KeyError naming
        the row or column and those the matrix has, for one it does not have."""
        for given, ids, kind in ((row, self.rows, "row"), (col, self.cols, "column")):
            if given not in ids:
                raise KeyError(f"{self.name} has no {kind} {given!r}; its {kind}s: {', '.join(map(str, ids))}")
        return self.values[self.rows.index(row)][self.cols.index(col)]

    def local(self, row: int) -> float | None:
        """The row's local cell (same node as row and column), where the matrix has one."""
        if self.kind.col_kind not in NODE_KINDS or row not in self.cols:
            return None
        return self.value(row, row)

    def remote_over_local(self, row: int) -> list[tuple[int, float]]:
        """(column, value / local value) for each measured remote cell of ``row``."""
        local = self.local(row)
        if not local:
            return []
        return [
            (col, value / local)
            for col, value in zip(self.cols, self.values[self.rows.index(row)], strict=True)
            if col != row and value is not None
        ]

    def to_dict(self) -> dict[str, Any]:
        kind = self.kind
        document: dict[str, Any] = {
            "unit": kind.unit,
            "better": kind.better,
            "description": kind.description,
            "row_kind": kind.row_kind,
            "rows": list(self.rows),
            "col_kind": kind.col_kind,
            "cols": list(self.cols),
            "values": [list(row) for row in self.values],
            "missing": dict(self.missing),
            "threads": [list(row) for row in self.threads],
            "bytes": self.bytes,
            "repetitions": self.repetitions,
            "warmup": self.warmup,
            "statistic": self.statistic,
            "per_repetition": self.per_repetition,
            "per_repetition_unit": self.per_repetition_unit,
            "placement": self.placement,
        }
        if self.streams is not None:
            document["streams"] = self.streams
        return document

    @classmethod
    def from_dict(cls, name: str, document: dict[str, Any]) -> Matrix:
        check_matrix(name, document)
        return cls(
            name=name,
            rows=list(document["rows"]),
            cols=list(document["cols"]),
            values=[[None if v is None else float(v) for v in row] for row in document["values"]],
            missing=dict(document["missing"]),
            threads=[list(row) for row in document["threads"]],
            bytes=document["bytes"],
            repetitions=document["repetitions"],
            warmup=document["warmup"],
            statistic=document["statistic"],
            per_repetition=document["per_repetition"],
            per_repetition_unit=document["per_repetition_unit"],
            placement=dict(document["placement"]),
            streams=document.get("streams"),
        )


@dataclass
class BenchResult:
    """A whole ``numafast bench`` run: settings, machine summary and matrices by name."""

    version: str
    created: str
    settings: dict[str, Any]
    machine: dict[str, Any]
    matrices: dict[str, Matrix]

    @property
    def placement_failures(self) -> list[str]:
        """"NAME[ROW,COL]: reason" for every cell whose placement check failed."""
        return [
            f"{name}[{key}]: {reason}"
            for name, matrix in self.matrices.items()
            for key, reason in matrix.missing.items()
            if reason.startswith(PLACEMENT_FAILED)
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "version": self.version,
            "created": self.created,
            "settings": self.settings,
            "machine": self.machine,
            "matrices": {name: matrix.to_dict() for name, matrix in self.matrices.items()},
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, document: dict[str, Any]) -> BenchResult:
        """The result a document holds; ValueError naming the first thing that breaks the schema."""
        check_document(document)
        return cls(
            version=document["version"],
            created=document["created"],
            settings=dict(document["settings"]),
            machine=dict(document["machine"]),
            matrices={name: Matrix.from_dict(name, m) for name, m in document["matrices"].items()},
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> BenchResult:
        """The result a JSON text holds; ValueError saying where it is not JSON or not the schema."""
        try:
            document = json.loads(text)
        except (TypeError, json.JSONDecodeError) as error:
            raise ValueError(f"not a JSON text of schema {SCHEMA}: {error}") from None
        return cls.from_dict(document)


# A placement check that fails makes its cell missing, with a reason that starts so.
PLACEMENT_FAILED = "placement check failed: "

_TOP_KEYS: dict[str, type] = {"schema": str, "version": str, "created": str, "settings": dict, "machine": dict, "matrices": dict}
_MATRIX_KEYS: dict[str, type] = {
    "unit": str, "better": str, "description": str, "row_kind": str, "rows": list, "col_kind": str,
    "cols": list, "values": list, "missing": dict, "threads": list, "bytes": int, "repetitions": int,
    "warmup": int, "statistic": str, "per_repetition": int, "per_repetition_unit": str, "placement": dict,
}  # fmt: skip


def _require(document: dict[str, Any], keys: dict[str, type], where: str) -> None:
    for key, expected in keys.items():
        if key not in document:
            raise ValueError(f"{where}: no {key!r}")
        value = document[key]
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ValueError(f"{where}: {key!r} is {type(value).__name__}, not {expected.__name__}")


def check_document(document: object) -> None:
    """ValueError unless ``document`` follows schema numafast.bench/1."""
    if not isinstance(document, dict):
        raise ValueError(f"a {SCHEMA} document is a JSON object, not {type(document).__name__}")
    if document.get("schema") != SCHEMA:
        raise ValueError(f"schema {document.get('schema')!r}: this numafast reads {SCHEMA}")
    _require(document, _TOP_KEYS, "document")
    for name, matrix in document["matrices"].items():
        check_matrix(name, matrix)


def check_matrix(name: str, document: object) -> None:
    """ValueError unless ``document`` is a well-formed matrix called ``name``."""
    if name not in MATRICES:
        raise ValueError(f"matrix {name!r}: not one of {', '.join(MATRICES)}")
    if not isinstance(document, dict):
        raise ValueError(f"matrix {name}: not a JSON object")
    _require(document, _MATRIX_KEYS, f"matrix {name}")
    kind = MATRICES[name]
    for key in ("unit", "better", "row_kind", "col_kind"):
        if document[key] != getattr(kind, key):
            raise ValueError(f"matrix {name}: {key} {document[key]!r}, expected {getattr(kind, key)!r}")
    if document["statistic"] not in STATISTICS:
        raise ValueError(f"matrix {name}: statistic {document['statistic']!r} is not one of {STATISTICS}")
    if document["per_repetition_unit"] not in PER_REPETITION_UNITS:
        raise ValueError(f"matrix {name}: per_repetition_unit {document['per_repetition_unit']!r}")
    rows, cols = document["rows"], document["cols"]
    for what, grid in (("values", document["values"]), ("threads", document["threads"])):
        if len(grid) != len(rows) or any(not isinstance(r, list) or len(r) != len(cols) for r in grid):
            raise ValueError(f"matrix {name}: {what} is not {len(rows)} rows of {len(cols)} columns")
    expected_missing = set()
    for row, line in zip(rows, document["values"], strict=True):
        for col, value in zip(cols, line, strict=True):
            if value is None:
                expected_missing.add(cell_key(row, col))
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"matrix {name}: cell {row},{col} holds {value!r}, not a positive number")
    if set(document["missing"]) != expected_missing:
        unexplained = sorted(expected_missing - set(document["missing"]))
        extra = sorted(set(document["missing"]) - expected_missing)
        raise ValueError(f"matrix {name}: null cells without a reason {unexplained}, reasons for numbers {extra}")
