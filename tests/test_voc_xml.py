"""parse_annotation must equal torchvision's parse_voc_xml(ET.parse(...)), key order included."""

from __future__ import annotations

import io
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchvision.datasets import VOCDetection
from vocfactory import (
    OMIT,
    build_corner_case_devkit,
    encode_xml,
    obj,
    real_voc_roots,
    real_voc_skip_reason,
    voc_xml,
)

from torch_serialized.errors import SourceDataError
from torch_serialized.voc.xml import VOCObjects, extract_objects, parse_annotation


def ordered(value: Any) -> Any:
    """``value`` with every dict turned into a list of items, so comparisons see key order."""
    if isinstance(value, dict):
        return [(key, ordered(item)) for key, item in value.items()]
    if isinstance(value, list):
        return [ordered(item) for item in value]
    return value


def torchvision_target(data: bytes) -> dict[str, Any]:
    """The oracle: what ``VOCDetection.__getitem__`` builds from these bytes."""
    return VOCDetection.parse_voc_xml(ET.parse(io.BytesIO(data)).getroot())


def assert_same_as_torchvision(data: bytes, source: str) -> dict[str, Any] | None:
    """Check ``parse_annotation`` against torchvision; both must fail when torchvision does."""
    try:
        expected = torchvision_target(data)
    except (SyntaxError, ValueError, LookupError):
        with pytest.raises(SourceDataError, match=source):
            parse_annotation(data, source=source)
        return None
    ours = parse_annotation(data, source=source)
    assert ours == expected, source
    assert ordered(ours) == ordered(expected), source
    return ours


@pytest.fixture(scope="module")
def corner_xml(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = build_corner_case_devkit(tmp_path_factory.mktemp("corner"))
    return sorted((root / "VOCdevkit" / "VOC2007" / "Annotations").glob("*.xml"))


# --- torchvision as the oracle ------------------------------------------------------------------


def test_corner_case_devkit_matches_torchvision(corner_xml: list[Path]) -> None:
    assert len(corner_xml) == 23
    for path in corner_xml:
        ours = parse_annotation(path.read_bytes(), source=str(path))
        expected = VOCDetection.parse_voc_xml(ET.parse(path).getroot())
        assert ordered(ours) == ordered(expected), path.name


@pytest.mark.parametrize(
    "root", [root for root, _ in real_voc_roots()] or [None], ids=lambda r: getattr(r, "name", "")
)
def test_real_voc_matches_torchvision(root: Path | None) -> None:
    if root is None:
        pytest.skip(real_voc_skip_reason())
    paths = sorted(root.glob("VOCdevkit/VOC*/Annotations/*.xml"))
    assert paths
    for path in paths:
        ours = parse_annotation(path.read_bytes(), source=str(path))
        expected = VOCDetection.parse_voc_xml(ET.parse(path).getroot())
        assert ordered(ours) == ordered(expected), path.name
        objects = extract_objects(ours, source=str(path))
        assert len(objects.names) == len(ours["annotation"]["object"]) > 0


@pytest.mark.parametrize(
    ("encoding", "bom"),
    [
        ("utf-8", False),
        ("utf-8", True),
        ("UTF-16", False),
        ("UTF-16BE", True),
        ("UTF-16LE", False),
        ("ISO-8859-1", False),
        ("windows-1252", False),
        ("us-ascii", False),
    ],
)
def test_declared_encodings(encoding: str, bom: bool) -> None:
    text = voc_xml("é.jpg", 10, 10, [obj("dog", (1, 2, 3, 4), pose="Façade €")])
    data = encode_xml(text, encoding)
    if bom:
        data = "\ufeff".encode(encoding) + data
    target = assert_same_as_torchvision(data, "enc.xml")
    assert target is not None
    assert target["annotation"]["object"][0]["pose"] == "Façade €"
    assert target["annotation"]["filename"] == "é.jpg"


# --- torchvision's quirks, spelled out ----------------------------------------------------------


@pytest.mark.parametrize(
    ("xml", "expected"),
    [
        # one object is still a list; a leaf's text is stripped
        (
            "<annotation><object><name> dog </name></object></annotation>",
            {"annotation": {"object": [{"name": "dog"}]}},
        ),
        # no object: "object" is appended last as []
        (
            "<annotation><filename>a</filename></annotation>",
            {"annotation": {"filename": "a", "object": []}},
        ),
        # empty leaves are dropped; whitespace-only ones become ""; parent text is ignored
        (
            "<annotation>x<pose/><a></a><b> \n</b><c>t<d>1</d></c></annotation>",
            {"annotation": {"b": "", "c": {"d": "1"}, "object": []}},
        ),
        # a parent whose children are all empty is kept as {}
        (
            "<annotation><size><width/></size></annotation>",
            {"annotation": {"size": {}, "object": []}},
        ),
        # repeated tags become a list, a single one stays a dict
        (
            "<r><part><n>h</n></part><part><n>f</n></part><p><part><n>x</n></part></p></r>",
            {"r": {"part": [{"n": "h"}, {"n": "f"}], "p": {"part": {"n": "x"}}}},
        ),
        # any parent tagged annotation gets "object"; a leaf annotation is just text
        (
            "<r><annotation><a>1</a></annotation><s><annotation>VOC</annotation></s></r>",
            {"r": {"annotation": {"a": "1", "object": []}, "s": {"annotation": "VOC"}}},
        ),
        # an empty nested <annotation/> is dropped like any empty leaf
        ("<annotation><annotation/></annotation>", {"annotation": {"object": []}}),
        # an empty root gives {}, a text root its text
        ("<annotation/>", {}),
        ("<annotation> a </annotation>", {"annotation": "a"}),
        # "object" keeps the position of its first occurrence
        (
            "<annotation><object>1</object><z>2</z><object>3</object></annotation>",
            {"annotation": {"object": ["1", "3"], "z": "2"}},
        ),
    ],
)
def test_quirks(xml: str, expected: dict[str, Any]) -> None:
    target = assert_same_as_torchvision(xml.encode(), "quirk.xml")
    assert target is not None
    assert ordered(target) == ordered(expected)


TAGS = st.sampled_from(["annotation", "object", "part", "name", "bndbox", "pose", "x"])
XML_CHARS = st.characters(codec="utf-8", exclude_categories=("Cc", "Cs", "Cn"))
TEXT = st.one_of(
    st.none(),
    st.just(""),
    st.text(alphabet=" \t\n\r", max_size=4),
    st.text(alphabet=st.one_of(XML_CHARS, st.sampled_from(" \t\n<>&'\"")), max_size=8),
)


def _element(draw: st.DrawFn, depth: int) -> ET.Element:
    element = ET.Element(draw(TAGS))
    element.text = draw(TEXT)
    element.tail = draw(TEXT)
    if depth < 4:
        for _ in range(draw(st.integers(0, 4 if depth < 2 else 2))):
            if draw(st.integers(0, 9)) == 0:
                element.append(ET.Comment(draw(st.sampled_from(["c", " x "]))))
            else:
                element.append(_element(draw, depth + 1))
    return element


@st.composite
def documents(draw: st.DrawFn) -> bytes:
    root = _element(draw, 0)
    root.tail = None  # text after the root element is not XML
    if draw(st.booleans()):
        root.tag = "annotation"
    encoding = draw(st.sampled_from(["utf-8", "us-ascii", "iso-8859-1", "utf-16"]))
    return ET.tostring(root, encoding=encoding)


@settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(documents())
def test_random_trees_match_torchvision(data: bytes) -> None:
    assert_same_as_torchvision(data, "random.xml")


# --- safety and errors --------------------------------------------------------------------------

BILLION_LAUGHS = (
    '<?xml version="1.0"?>\n<!DOCTYPE lolz [\n <!ENTITY lol "lol">\n'
    + "".join(
        f' <!ENTITY lol{i} "{("&lol" + (str(i - 1) if i > 1 else "") + ";") * 10}">\n'
        for i in range(1, 10)
    )
    + "]>\n<annotation><name>&lol9;</name></annotation>"
)

UNSAFE = {
    "billion_laughs": BILLION_LAUGHS.encode(),
    "billion_laughs_utf16": BILLION_LAUGHS.encode("utf-16"),
    "quadratic": (f'<!DOCTYPE a [<!ENTITY a "{"x" * 100_000}">]><a>{"&a;" * 10_000}</a>'.encode()),
    "external_entity": (
        b'<!DOCTYPE x [<!ENTITY e SYSTEM "file:///etc/passwd">]><annotation>&e;</annotation>'
    ),
    "external_dtd": b'<!DOCTYPE annotation SYSTEM "http://example.com/voc.dtd"><annotation/>',
    "public_dtd": b'<!DOCTYPE a PUBLIC "-//X//DTD X//EN" "http://example.com/x.dtd"><a/>',
    "parameter_entity": (
        b'<!DOCTYPE a [<!ENTITY % p SYSTEM "http://example.com/p.dtd"> %p;]><a>&e;</a>'
    ),
    "unparsed_entity": (
        b'<!DOCTYPE a [<!NOTATION n SYSTEM "n"><!ENTITY u SYSTEM "u.bin" NDATA n>]><a/>'
    ),
    "internal_entity": b'<!DOCTYPE a [<!ENTITY e "harmless">]><a>&e;</a>',
}


@pytest.mark.parametrize("name", sorted(UNSAFE))
def test_unsafe_xml_is_refused_fast(name: str) -> None:
    start = time.perf_counter()
    with pytest.raises(SourceDataError, match=rf"bad_{name}\.xml: refusing unsafe XML"):
        parse_annotation(UNSAFE[name], source=f"bad_{name}.xml")
    assert time.perf_counter() - start < 0.5


def test_doctype_without_entities_is_allowed() -> None:
    data = b'<?xml version="1.0"?>\n<!DOCTYPE annotation>\n<annotation><a>1</a></annotation>'
    assert assert_same_as_torchvision(data, "ok.xml") == {"annotation": {"a": "1", "object": []}}


@pytest.mark.parametrize(
    ("data", "where"),
    [
        (b"<annotation>\n<object>\n</annotation>", "line 3, column 3"),
        (b"<annotation>\n<name>x</name>", "line 2, column 15"),
        (b"", "line 1, column 1"),
        (b"<annotation>&nbsp;</annotation>", "line 1, column 13"),
        (b"<a>\n<x:b/></a>", "line 2, column 1"),
        (b"<a>\xff</a>", "line 1, column 4"),
    ],
)
def test_malformed_xml_names_source_line_and_column(data: bytes, where: str) -> None:
    with pytest.raises(
        SourceDataError, match=rf"Annotations/broken\.xml: malformed XML at {where}"
    ):
        parse_annotation(data, source="Annotations/broken.xml")
    with pytest.raises(ET.ParseError):  # torchvision fails on the same bytes
        torchvision_target(data)


@pytest.mark.parametrize(
    ("encoding", "codec"),
    [("bogus", "ascii"), ("gbk", "gbk"), ("utf-16-be", "utf-16"), ("cp500", "ascii")],
)
def test_unsupported_declared_encoding(encoding: str, codec: str) -> None:
    data = f'<?xml version="1.0" encoding="{encoding}"?><a>x</a>'.encode(codec)
    with pytest.raises(SourceDataError, match=r"^enc\.xml: .*(not supported|malformed)"):
        parse_annotation(data, source="enc.xml")
    with pytest.raises((ValueError, LookupError, SyntaxError)):  # torchvision fails as well
        torchvision_target(data)


def test_too_deep_nesting_is_a_source_error() -> None:
    data = b"<a>" * 5000 + b"x" + b"</a>" * 5000
    with pytest.raises(SourceDataError, match="deep.xml: elements are nested too deeply"):
        parse_annotation(data, source="deep.xml")


# --- extract_objects -------------------------------------------------------------------------


def objects_of(xml: bytes) -> VOCObjects:
    return extract_objects(parse_annotation(xml, source="t.xml"), source="t.xml")


def test_extract_objects_fractional_boxes_any_child_order() -> None:
    box = {"xmin": "91.0", "xmax": "254.38461538461536", "ymin": " 2.5 ", "ymax": "39"}
    objects = objects_of(voc_xml("a.jpg", 300, 40, [obj("bus", box), obj("car", (1, 2, 3, 4))]))
    assert objects.boxes.dtype == np.float32 and objects.boxes.shape == (2, 4)
    expected = np.array([[91.0, 2.5, 254.38461538461536, 39.0], [1, 2, 3, 4]], dtype=np.float32)
    np.testing.assert_array_equal(objects.boxes, expected)
    assert objects.names == ["bus", "car"]


def test_extract_objects_zero_objects() -> None:
    objects = objects_of(voc_xml("a.jpg", 10, 10, []))
    assert objects.names == []
    assert objects.boxes.shape == (0, 4) and objects.boxes.dtype == np.float32
    assert objects.difficult.shape == (0,) and objects.difficult.dtype == np.uint8
    assert objects.truncated.shape == (0,) and objects.truncated.dtype == np.uint8


def test_extract_objects_flags_missing_empty_and_set() -> None:
    xml = voc_xml(
        "a.jpg",
        10,
        10,
        [
            obj("a", (1, 1, 2, 2), difficult=OMIT, truncated=OMIT),
            obj("b", (1, 1, 2, 2), difficult=None, truncated="  "),
            obj("c", (1, 1, 2, 2), difficult=1, truncated=1),
            obj("d", (1, 1, 2, 2), difficult=0, truncated=0),
        ],
    )
    objects = objects_of(xml)
    assert objects.difficult.tolist() == [0, 0, 1, 0]
    assert objects.truncated.tolist() == [0, 0, 1, 0]
    assert objects.difficult.dtype == objects.truncated.dtype == np.uint8


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (obj("x", (1, 2, 3, 4), bndbox=OMIT), r"object 1 has no single <bndbox>"),
        (obj("x", {"xmin": 1, "ymin": 2, "xmax": 3}), r"object 1: <bndbox><ymax> is None"),
        (obj("x", (1, "two", 3, 4)), r"object 1: <bndbox><ymin> is 'two'"),
        (obj("x", (1, 2, "nan", 4)), r"object 1: <bndbox><xmax> is 'nan'"),
        (obj("x", (1, 2, "1e39", 4)), r"object 1: <bndbox><xmax> is '1e39', not a finite float32"),
        (obj("x", ("-1e39", 2, 3, 4)), r"object 1: <bndbox><xmin> is '-1e39', not a finite"),
        (obj("x", (1, 2, 3, 4), name=OMIT), r"object 1 has no single non-empty <name>"),
        (obj("x", (1, 2, 3, 4), difficult="yes"), r"object 1: <difficult> is 'yes'"),
    ],
)
def test_extract_objects_errors_name_source_and_index(bad: dict[str, Any], message: str) -> None:
    target = parse_annotation(voc_xml("a.jpg", 9, 9, [obj("ok", (1, 1, 2, 2)), bad]), source="s")
    with pytest.raises(SourceDataError, match=rf"^Annotations/s\.xml: {message}"):
        extract_objects(target, source="Annotations/s.xml")


def test_extract_objects_needs_an_annotation_root() -> None:
    with pytest.raises(SourceDataError, match="r.xml: the root element is not"):
        extract_objects(
            parse_annotation(b"<other><a>1</a></other>", source="r.xml"), source="r.xml"
        )
