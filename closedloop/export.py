"""``closedloop export``: a run's trace records as Parquet tables or a Hugging Face dataset.

Every ``traces/*.jsonl`` of the run directory is read strictly (``read_trace``: the first
corrupt line is a ``TraceFormatError`` naming it) and its records go to three tables, one per
record kind, each row carrying the trace file's stem in the column ``trace``:

- ``turns`` (``TurnRecord``), ``trajectories`` (``TrajectoryRecord``), ``groups``
  (``GroupLease``).

Columns follow the record fields, typed from their annotations: ``str``/``int``/``float``/
``bool`` as Arrow scalars, ``list[int]``/``list[float]`` as lists (token ids, log-probs, mask),
``dict[str, float]`` (reward vectors, timings) as lists of ``{key, value}`` structs (Hugging Face
``datasets`` has no map type), nested records (``sampler_config``) as structs, enums and
literals as strings, and free-form ``dict[str, Any]`` (``tool_args``) as canonical JSON text.
``None`` is null.

``--format parquet`` writes ``turns.parquet``, ``trajectories.parquet``, ``groups.parquet``;
``--format hf`` writes a ``datasets.DatasetDict`` with those three splits (``save_to_disk``;
no network). Both write ``export.json``: the source files with their sha256 and record counts.
``export_run`` then reads the export back (``read_export``) and checks that every record equals
the JSONL record it came from, in order (``ExportMismatchError`` otherwise). pyarrow and
datasets are the optional extra ``closedloop[export]``; without them ``ExportDependencyError``
says so.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Union

from closedloop.contracts import (
    GroupLease,
    TrajectoryRecord,
    TurnRecord,
    canonical_json,
    read_trace,
    sha256_hex,
)
from closedloop.contracts.schema import decode_record
from closedloop.errors import (
    ExportDependencyError,
    ExportError,
    ExportMismatchError,
)

EXPORT_FORMAT = "closedloop-export-v1"
Format = Literal["parquet", "hf"]
TABLES: Mapping[str, type] = {"turns": TurnRecord, "trajectories": TrajectoryRecord,
                              "groups": GroupLease}
_KIND_TABLE = {"turn": "turns", "trajectory": "trajectories", "group": "groups"}


@dataclass(frozen=True)
class ExportResult:
    """Where the export went and how many records of each kind it holds."""

    path: Path
    format: str
    counts: Mapping[str, int]
    sources: tuple[str, ...]


def _require(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ExportDependencyError(f"closedloop export needs {module!r}: pip install "
                                    "'closedloop[export]'") from None


# --------------------------------------------------------------------------- schema
def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _is_json_text(tp: Any) -> bool:
    tp = _unwrap_optional(tp)
    return typing.get_origin(tp) is dict and typing.get_args(tp)[1] is Any


def _is_pairs(tp: Any) -> bool:
    tp = _unwrap_optional(tp)
    return typing.get_origin(tp) is dict and typing.get_args(tp)[1] is not Any


def arrow_type(tp: Any) -> Any:
    """The Arrow type of a record field's annotation (see the module docstring)."""
    pa = _require("pyarrow")
    tp = _unwrap_optional(tp)
    origin = typing.get_origin(tp)
    scalars = {str: pa.string(), int: pa.int64(), float: pa.float64(), bool: pa.bool_()}
    if tp in scalars:
        return scalars[tp]
    if origin is Literal or (isinstance(tp, type) and issubclass(tp, Enum)):
        return pa.string()
    if origin is list:
        return pa.list_(arrow_type(typing.get_args(tp)[0]))
    if _is_json_text(tp):
        return pa.string()
    if origin is dict:
        return pa.list_(pa.struct([("key", pa.string()),
                                   ("value", arrow_type(typing.get_args(tp)[1]))]))
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return pa.struct([(f.name, arrow_type(hints[f.name]))
                          for f in dataclasses.fields(tp)])
    raise ExportError(f"no Arrow type for the field annotation {tp!r}")


def arrow_schema(cls: type) -> Any:
    """The table schema of a record class: ``trace`` and then its fields, in order."""
    pa = _require("pyarrow")
    hints = typing.get_type_hints(cls)
    return pa.schema([("trace", pa.string())] +
                     [(f.name, arrow_type(hints[f.name])) for f in dataclasses.fields(cls)])


def _to_cell(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    if _is_json_text(tp):
        return canonical_json(value)
    if _is_pairs(tp):
        return [{"key": k, "value": _to_cell(typing.get_args(_unwrap_optional(tp))[1], v)}
                for k, v in value.items()]
    if isinstance(value, Enum):
        return value.value
    inner = _unwrap_optional(tp)
    if dataclasses.is_dataclass(inner):
        hints = typing.get_type_hints(inner)
        return {f.name: _to_cell(hints[f.name], getattr(value, f.name))
                for f in dataclasses.fields(inner)}
    return value


def _from_cell(tp: Any, cell: Any) -> Any:
    if cell is None:
        return None
    if _is_json_text(tp):
        return json.loads(cell)
    if _is_pairs(tp):
        value_tp = typing.get_args(_unwrap_optional(tp))[1]
        return {pair["key"]: _from_cell(value_tp, pair["value"]) for pair in cell}
    inner = _unwrap_optional(tp)
    if dataclasses.is_dataclass(inner):
        hints = typing.get_type_hints(inner)
        return {f.name: _from_cell(hints[f.name], cell[f.name])
                for f in dataclasses.fields(inner)}
    return cell


def records_table(cls: type, rows: Sequence[tuple[str, Any]]) -> Any:
    """An Arrow table of ``(trace stem, record)`` rows of one record class."""
    pa = _require("pyarrow")
    hints = typing.get_type_hints(cls)
    columns: dict[str, list[Any]] = {"trace": [stem for stem, _ in rows]}
    for f in dataclasses.fields(cls):
        columns[f.name] = [_to_cell(hints[f.name], getattr(r, f.name)) for _, r in rows]
    return pa.Table.from_pydict(columns, schema=arrow_schema(cls))


def table_records(cls: type, table: Any) -> list[tuple[str, Any]]:
    """The ``(trace stem, record)`` rows of a table (each record strictly decoded)."""
    hints = typing.get_type_hints(cls)
    out: list[tuple[str, Any]] = []
    for row in table.to_pylist():
        data = {f.name: _from_cell(hints[f.name], row[f.name]) for f in dataclasses.fields(cls)}
        out.append((row["trace"], decode_record(cls, data)))
    return out


# --------------------------------------------------------------------------- run export
def run_records(run_dir: str | Path) -> tuple[dict[str, list[tuple[str, Any]]], list[Path]]:
    """Every trace record of a run by table, in file then line order, and the files read."""
    files = sorted((Path(run_dir) / "traces").glob("*.jsonl"))
    if not files:
        raise ExportError(f"{run_dir}: no traces/*.jsonl to export")
    tables: dict[str, list[tuple[str, Any]]] = {name: [] for name in TABLES}
    for path in files:
        for record in read_trace(path):
            tables[_KIND_TABLE[record.record]].append((path.stem, record))
    return tables, files


def export_run(run_dir: str | Path, fmt: str, out: str | Path | None = None, *,
               overwrite: bool = False) -> ExportResult:
    """Write the run's records as ``fmt`` under ``out`` (default ``RUN_DIR/export/<fmt>``),
    then read them back and check every record (see the module docstring)."""
    if fmt not in ("parquet", "hf"):
        raise ExportError(f"--format must be parquet or hf, got {fmt!r}")
    target = Path(out) if out is not None else Path(run_dir) / "export" / fmt
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise ExportError(f"{target} exists and is not empty (pass --overwrite)")
    tables, files = run_records(run_dir)
    arrow = {name: records_table(TABLES[name], rows) for name, rows in tables.items()}
    target.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        pq = _require("pyarrow.parquet")
        for name, table in arrow.items():
            pq.write_table(table, target / f"{name}.parquet")
    else:
        datasets = _require("datasets")
        splits = {name: datasets.Dataset(table) for name, table in arrow.items()}
        datasets.DatasetDict(splits).save_to_disk(str(target))
    sources = tuple(str(p) for p in files)
    counts = {name: len(rows) for name, rows in tables.items()}
    manifest = {"format": EXPORT_FORMAT, "export": fmt, "counts": counts,
                "sources": {p.name: sha256_hex(p.read_bytes()) for p in files}}
    (target / "export.json").write_text(canonical_json(manifest) + "\n", encoding="utf-8")
    back = read_export(target, fmt)
    for name, rows in tables.items():
        _compare(name, rows, back[name])
    return ExportResult(target, fmt, counts, sources)


def read_export(path: str | Path, fmt: str) -> dict[str, list[tuple[str, Any]]]:
    """The ``(trace stem, record)`` rows of each table of an export."""
    path = Path(path)
    if fmt == "parquet":
        pq = _require("pyarrow.parquet")
        return {name: table_records(cls, pq.read_table(path / f"{name}.parquet"))
                for name, cls in TABLES.items()}
    if fmt == "hf":
        datasets = _require("datasets")
        loaded = datasets.load_from_disk(str(path))
        return {name: table_records(cls, loaded[name].data.table) for name, cls in
                TABLES.items()}
    raise ExportError(f"format must be parquet or hf, got {fmt!r}")


def _compare(name: str, expected: Sequence[tuple[str, Any]],
             got: Sequence[tuple[str, Any]]) -> None:
    if len(expected) != len(got):
        raise ExportMismatchError(f"{name}: {len(got)} records read back, {len(expected)} "
                                  "written")
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        if want != have:
            raise ExportMismatchError(f"{name} row {i} (trace {want[0]!r}) differs from its "
                                      "JSONL record after the round trip")
