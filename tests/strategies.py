"""Hypothesis strategies for containers: any fields, records, columns, arrays and user data."""

from __future__ import annotations

from typing import Any

import numpy as np
from _container_helpers import payload
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from torch_serialized.container import spec as fmt

SIMPLE_CODES = ["|b1", "|i1", "|u1", "<i2", "<i4", "<i8", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8"]


def element(code: str) -> st.SearchStrategy[Any]:
    dtype = np.dtype(code)
    if dtype.kind == "b":
        return st.booleans()
    if dtype.kind == "f":
        return st.floats(width=8 * dtype.itemsize, allow_nan=False)
    info = np.iinfo(dtype)
    return st.integers(int(info.min), int(info.max))


payloads = st.one_of(
    st.binary(max_size=200),
    st.sampled_from([b"", b"\x00", bytes(63), bytes(64), bytes(65)]),
    st.integers(0, 5000).map(lambda n: payload(n, 0, n)),
)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-fmt.MAX_JSON_INT, fmt.MAX_JSON_INT)  # strict JSON's integers
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(blacklist_categories=("Cs",)), max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def datasets(draw: st.DrawFn) -> dict[str, Any]:
    k = draw(st.integers(1, 4))
    fields = draw(
        st.lists(st.text("abcxyz_é", min_size=1, max_size=5), min_size=k, max_size=k, unique=True)
    )
    n = draw(st.integers(0, 12))
    records = draw(st.lists(st.lists(payloads, min_size=k, max_size=k), min_size=n, max_size=n))
    columns = rows = None
    if draw(st.booleans()):
        spec = draw(
            st.lists(
                st.tuples(st.sampled_from("pqrs"), st.sampled_from(SIMPLE_CODES)),
                min_size=1,
                max_size=3,
                unique_by=lambda t: t[0],
            )
        )
        columns = np.dtype(spec)
        rows = [draw(st.tuples(*(element(c) for _, c in spec))) for _ in range(n)]
    arrays = draw(
        st.dictionaries(
            st.sampled_from(["classes", "index", "meta", "x"]),
            hnp.arrays(
                st.sampled_from(SIMPLE_CODES).map(np.dtype),
                hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
            ),
            max_size=3,
        )
    )
    user = draw(st.dictionaries(st.text(max_size=6), json_values, max_size=4))
    return {
        "fields": fields,
        "records": records,
        "columns": columns,
        "rows": rows,
        "arrays": arrays,
        "user": user,
    }


limits = st.one_of(
    st.fixed_dictionaries({"max_records_per_shard": st.integers(1, 5)}),
    st.fixed_dictionaries({"max_shard_bytes": st.integers(1, 3000)}),
    st.fixed_dictionaries(
        {"max_records_per_shard": st.integers(1, 5), "max_shard_bytes": st.integers(1, 3000)}
    ),
)
