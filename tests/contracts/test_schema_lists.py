"""Lists of token ids and log-probs decode and encode in one pass (``closedloop.contracts.schema``):
the result, and the error of a bad list, are those of the item-by-item path."""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from closedloop.contracts import schema
from closedloop.errors import FieldError

ITEMS = st.one_of(st.integers(-2**40, 2**40), st.floats(allow_nan=True, allow_infinity=True),
                  st.booleans(), st.text(max_size=3), st.none())
LISTS = st.one_of(st.lists(st.integers(0, 49151), max_size=30),
                  st.lists(st.floats(-30, 0), max_size=30), st.lists(ITEMS, max_size=8))


def _item_by_item(tp: Any, value: Any) -> Any:
    with mock.patch.object(schema, "_plain_list", lambda *_: False):
        return _outcome(tp, value)


def _outcome(tp: Any, value: Any) -> Any:
    try:
        return ("ok", schema._decode(tp, value, "f"))
    except FieldError as exc:
        return ("error", exc.field, exc.reason)


@pytest.mark.parametrize("tp", [list[int], list[float], list[int] | None, list[str]])
@given(value=LISTS)
@settings(max_examples=150, deadline=None)
def test_a_list_decodes_as_its_items_would(tp, value):
    fast = _outcome(tp, value)
    assert fast == _item_by_item(tp, value)
    if fast[0] == "ok" and fast[1] is not None and tp in (list[float],):
        assert all(type(v) is float and math.isfinite(v) for v in fast[1])


def test_a_bad_item_is_named_by_its_index():
    with pytest.raises(FieldError) as info:
        schema._decode(list[int], [1, 2, True, 4], "ids")
    assert info.value.field == "ids[2]"
    with pytest.raises(FieldError, match="not finite") as info:
        schema._decode(list[float], [-0.5, float("nan")], "lps")
    assert info.value.field == "lps[1]"
    assert schema._decode(list[float], [-1, -0.5], "lps") == [-1.0, -0.5]  # ints widened


class _Kind(StrEnum):
    TOOL = "tool"


@given(st.lists(st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=3),
                          st.booleans(), st.none(), st.just(_Kind.TOOL)), max_size=10))
@settings(max_examples=100, deadline=None)
def test_a_list_encodes_as_its_items_would(value):
    got = schema.encode_record(value)
    assert got == [schema.encode_record(v) for v in value]
    assert all(type(v) is not _Kind for v in got)  # an enum item still becomes its value
    assert schema.encode_record(tuple(value)) == got
