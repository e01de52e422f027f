"""The VOC record schema and its codecs: targets, ids and objects come back as they went in."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_serialized.voc import schema

# torchvision's target: nested dicts and lists of strings, any text XML can carry.
_xml_text = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12
)


_targets = st.recursive(
    _xml_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_xml_text, inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_xml_text, _targets, max_size=4))
def test_stored_target_round_trips_exactly(target: dict[str, Any]) -> None:
    """The stored target (json.dumps at pack time, orjson at read time) comes back equal, key
    order included, for any text: the reader's parser must not be a different dialect."""
    import json

    from torch_serialized.voc import schema

    stored = schema.encode_target(target)
    for data in (stored, memoryview(stored), np.frombuffer(stored, np.uint8).data):
        back = schema.decode_target(data)
        assert back == target == json.loads(stored)
        assert json.dumps(back) == json.dumps(target)  # same key order at every level


def _nested(levels: int) -> dict[str, Any]:
    """A target whose JSON nests lists and dicts ``levels`` deep (the top dict included)."""
    inner: Any = "x"
    for level in range(levels - 1):
        inner = [inner] if level % 2 else {"n": inner}
    return {"annotation": inner}


@pytest.fixture
def deep_recursion() -> Iterator[None]:
    """A recursion limit at which ``json`` writes documents deeper than orjson reads, as it
    does on Python >= 3.12 under the default limit (C recursion is checked apart there)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    yield
    sys.setrecursionlimit(limit)


@pytest.mark.usefixtures("deep_recursion")
def test_a_target_nested_as_deep_as_the_reader_parses_is_stored() -> None:
    target = _nested(schema.MAX_TARGET_DEPTH)
    assert schema.decode_target(schema.encode_target(target)) == target


@pytest.mark.usefixtures("deep_recursion")
def test_a_target_nested_deeper_than_the_reader_parses_is_refused() -> None:
    """Stored, it would read back as a damaged pack ("not valid JSON"), on every re-pack."""
    with pytest.raises(schema.TargetTooDeepError, match="deeper than the 1024 levels"):
        schema.encode_target(_nested(schema.MAX_TARGET_DEPTH + 1))


def test_a_target_deeper_than_json_writes_is_refused_as_too_deep() -> None:
    with pytest.raises(schema.TargetTooDeepError, match="recursion limit"):
        schema.encode_target(_nested(100_000))  # past C recursion checks too


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(st.characters(blacklist_categories=("Cs",)), max_size=10), max_size=30))
def test_ids_round_trip(ids: list[str]) -> None:
    blob, offsets = schema.encode_ids(ids)
    assert blob.dtype == np.uint8 and offsets.dtype == np.dtype("<u8")
    assert len(offsets) == len(ids) + 1 and int(offsets[-1]) == len(blob)
    assert [schema.decode_id(blob, offsets, i) for i in range(len(ids))] == ids


def test_objects_are_one_row_each_in_document_order() -> None:
    boxes = np.array([[1, 2, 3, 4], [5.5, 6, 7, 8.25]], dtype=np.float32)
    data = schema.encode_objects(boxes, [3, 0], np.array([0, 1]), np.array([1, 0]))
    rows = np.frombuffer(data, dtype=schema.OBJECT_DTYPE)
    assert len(data) == 2 * schema.OBJECT_DTYPE.itemsize
    assert rows["box"].tolist() == boxes.tolist()
    assert rows["class_id"].tolist() == [3, 0]
    assert rows["difficult"].tolist() == [0, 1] and rows["truncated"].tolist() == [1, 0]
    assert schema.encode_objects(np.zeros((0, 4), np.float32), [], np.zeros(0), np.zeros(0)) == b""


def test_fields_columns_and_split_names() -> None:
    assert schema.FIELDS[schema.IMAGE] == "image" and schema.FIELDS[schema.MASK] == "mask"
    assert schema.FIELDS[schema.TARGET] == "target" and schema.FIELDS[schema.OBJECTS] == "objects"
    assert schema.COLUMNS.names == ("width", "height", "num_objects", "flags")
    flags = (schema.HAS_ANNOTATION, schema.HAS_MASK, schema.HAS_OBJECT_MASK)
    assert sorted(flags) == [1, 2, 4]
    assert schema.split_array_name("Main", "trainval") == "split/Main/trainval"


def test_a_pack_is_written_as_the_lowest_schema_version_that_holds_it() -> None:
    """Unparsed annotations need 4 whatever else the pack holds, untyped objects 3, retired
    records 2; a pack of none of them is 1, which every reader reads."""
    for retired in (False, True):
        for untyped in (False, True):
            for unparsed in (False, True):
                want = 4 if unparsed else 3 if untyped else 2 if retired else 1
                got = schema.schema_version(retired=retired, untyped=untyped, unparsed=unparsed)
                assert got == want, (retired, untyped, unparsed)
