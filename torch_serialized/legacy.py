"""The original design's API, kept for code written against it: ``Serializer`` and
``SerializedDataset``. New code uses ``pack_voc`` and ``VOCSerializedDataset``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .data.decode import SampleDecoder
from .voc import schema
from .voc.pack import PackResult, pack_voc
from .voc.packed import VOCPackReader

__all__ = ["Serializer", "SerializedDataset"]


class Serializer:
    """The original design's packer: ``Serializer(source_dir, output_file).serialize()``.
    ``source_dir`` is the ``VOCdevkit/VOC20xx`` folder; ``kwargs`` go to ``pack_voc``."""

    def __init__(
        self, source_dir: str | os.PathLike[str], output_file: str | os.PathLike[str], **kwargs: Any
    ) -> None:
        self.source_dir = Path(source_dir)
        self.output_file = Path(output_file)
        self.kwargs = kwargs

    def serialize(self) -> PackResult:
        """Pack ``source_dir`` into ``output_file``."""
        return pack_voc(self.source_dir, self.output_file, **self.kwargs)


class SerializedDataset:
    """Every live packed sample in storage order, as in the original design: ``get_sample(i)``
    is ``{"id", "image": HWC uint8 array, "target": dict}`` (``{}`` without a parsed annotation)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit_bytes: int | None = None,
    ) -> None:
        self.pack = VOCPackReader(
            path,
            storage_options=storage_options,
            cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )
        self.decoder = SampleDecoder(self.pack)
        self.records = self.pack.live

    def __len__(self) -> int:
        return len(self.records)

    def get_sample(self, index: int) -> dict[str, Any]:
        """The sample at ``index`` (negative counts from the end)."""
        record = int(self.records[range(len(self.records))[index]])
        pack = self.pack
        data = pack.field(record, schema.TARGET)  # present exactly when parsed (checked at open)
        target = self.decoder.target(record, data) if len(data) else {}
        return {
            "id": pack.id(record),
            "image": np.asarray(self.decoder.image(record, pack.field(record, schema.IMAGE))),
            "target": target,
        }

    __getitem__ = get_sample
