"""Strict decoding of JSON objects into frozen dataclass records.

``decode_record(cls, data)`` checks every field against the dataclass's type hints: unknown keys,
missing required fields, wrong types (``bool`` is not an ``int``), non-finite floats, and nested
records. A failure raises ``FieldError(field, reason)`` with a dotted field path.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from enum import Enum
from functools import cache
from typing import Any, TypeVar, Union

from closedloop.errors import ContractError, FieldError

T = TypeVar("T")


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def decode_record(cls: type[T], data: Any, path: str = "") -> T:
    """Build ``cls`` (a dataclass) from a JSON object, validating every field."""
    if not isinstance(data, dict):
        raise FieldError(path or "<record>", f"expected an object, got {type(data).__name__}")
    hints = _hints(cls)  # type: ignore[arg-type]
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key in data:
        if key not in fields:
            raise FieldError(_join(path, key), "unknown field")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        where = _join(path, name)
        if name not in data:
            has_default = (f.default is not dataclasses.MISSING
                           or f.default_factory is not dataclasses.MISSING)
            if has_default:
                continue
            raise FieldError(where, "missing required field")
        values[name] = _decode(hints[name], data[name], where)
    try:
        return cls(**values)
    except ContractError as exc:
        if isinstance(exc, FieldError):
            raise
        raise FieldError(path or "<record>", str(exc)) from None


_PLAIN = frozenset({int, float, str, bool, type(None)})
"""Types whose values are their own JSON form (exact types: an ``Enum`` over ``str`` is not)."""


def encode_record(record: Any) -> Any:
    """Return the JSON form of a dataclass record (enums as values, nested records as objects)."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {f.name: encode_record(getattr(record, f.name))
                for f in dataclasses.fields(record)}
    if isinstance(record, Enum):
        return record.value
    if isinstance(record, list | tuple):
        if all(type(v) in _PLAIN for v in record):  # token ids, log-probs: already JSON
            return list(record)
        return [encode_record(v) for v in record]
    if isinstance(record, dict):
        return {k: encode_record(v) for k, v in record.items()}
    return record


def _join(path: str, name: str | int) -> str:
    if isinstance(name, int):
        return f"{path}[{name}]"
    return f"{path}.{name}" if path else name


def _decode(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _decode(arg, value, where)
            except FieldError as exc:
                errors.append(exc.reason)
        raise FieldError(where, " or ".join(errors) if errors else "null not allowed")
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise FieldError(where, f"must be one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise FieldError(where, f"expected a list, got {type(value).__name__}")
        (item_tp,) = typing.get_args(tp) or (Any,)
        if _plain_list(item_tp, value):
            return list(value)
        return [_decode(item_tp, v, _join(where, i)) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise FieldError(where, f"expected an object, got {type(value).__name__}")
        _, val_tp = typing.get_args(tp) or (str, Any)
        return {k: _decode(val_tp, v, _join(where, k)) for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return tp(value)
        except ValueError:
            allowed = [m.value for m in tp]
            raise FieldError(where, f"must be one of {allowed}, got {value!r}") from None
    if dataclasses.is_dataclass(tp):
        return decode_record(tp, value, where)  # type: ignore[arg-type]
    return _decode_scalar(tp, value, where)


def _plain_list(item_tp: Any, value: list[Any]) -> bool:
    """Whether every item of ``value`` is already what ``_decode`` would return for
    ``item_tp`` ``int`` (an int, not a bool) or ``float`` (a finite float): one pass over a
    list of token ids or log-probs instead of a call per item. Any other list, or one with
    an item that is not (an int in a float list, a bool, a NaN), is decoded item by item,
    which converts or names the offending index."""
    if item_tp is int:
        return all(type(v) is int for v in value)
    if item_tp is float:
        return all(type(v) is float for v in value) and all(map(math.isfinite, value))
    return False


def _decode_scalar(tp: Any, value: Any, where: str) -> Any:
    if tp is bool:
        if not isinstance(value, bool):
            raise FieldError(where, f"expected a bool, got {type(value).__name__}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise FieldError(where, f"expected an int, got {type(value).__name__}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise FieldError(where, f"expected a number, got {type(value).__name__}")
        if not math.isfinite(value):
            raise FieldError(where, "number is not finite")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise FieldError(where, f"expected a string, got {type(value).__name__}")
        return value
    if tp is type(None):
        if value is not None:
            raise FieldError(where, "expected null")
        return None
    raise FieldError(where, f"unsupported field type {tp!r}")
