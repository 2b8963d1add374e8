"""Canonical JSON and content hashes."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from closedloop.contracts import canonical_json, content_hash
from closedloop.contracts.hashing import is_content_hash

values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    max_leaves=10,
)


@given(st.dictionaries(st.text(max_size=6), values, max_size=6))
def test_hash_ignores_key_order(d):
    reordered = dict(reversed(list(d.items())))
    assert content_hash(d) == content_hash(reordered)
    assert is_content_hash(content_hash(d))


@given(values, values)
def test_different_values_different_canonical_forms(a, b):
    if canonical_json(a) != canonical_json(b):
        assert content_hash(a) != content_hash(b)


def test_known_digest():
    # sha256 of the 2 bytes "{}"
    assert content_hash({}) == (
        "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_rejected(bad):
    with pytest.raises(ValueError):
        canonical_json({"x": bad})
