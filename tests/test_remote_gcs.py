"""Packs at ``gs://`` URLs through gcsfs, against a real GCS server on 127.0.0.1
(gcp-storage-emulator's JSON API, behind the fault proxy): the GCS side of the checks the
``remote`` matrix leaves out for GCS (``_remote_cases.NOT_GCS``: gcsfs asks a size with GETs
of metadata, no HEAD, and sets no read timeout), and what the matrix checks on S3 alone:
packing to and appending at a URL."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _reliability_helpers import PACK_FORMS, out_name
from test_remote_datasets import upload
from test_remote_pack import FAST, MANIFEST, PART, blob
from test_voc_append import YEAR, Source, as_bytes, pack

import torch_serialized as ts
from torch_serialized.remote.packs import resolve
from torch_serialized.remote.store import RemoteStore

if TYPE_CHECKING:
    from remote_fixtures import Remote

pytest_plugins = ["remote_fixtures"]


def test_a_download_asks_the_size_once(
    gcs_remote: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As over S3 and HTTP (test_remote_pack.py): a shard is one GET (gcsfs's ``get_file``
    asks its size, with ``info``); a single file: size, footer, whole file."""
    import gcsfs.core

    asked: list[str] = []
    info = gcsfs.core.GCSFileSystem._info

    async def counted(self: Any, path: str, **kwargs: Any) -> Any:
        asked.append(path.rsplit("/", 1)[-1])
        return await info(self, path, **kwargs)

    monkeypatch.setattr(gcsfs.core.GCSFileSystem, "_info", counted)
    data = {"a.tser": blob(PART // 2, 1), "b.tser": blob(3 * PART, 2), "one.tser": blob(99, 3)}
    gcs_remote.put("manifest.json", MANIFEST)
    for name, content in data.items():
        gcs_remote.put(name, content)
    options: dict[str, Any] = {"retry": FAST}
    with resolve(gcs_remote.url, gcs_remote.storage_options, tmp_path, **options) as pack:
        for name in ("a.tser", "b.tser"):
            assert pack.fetch_shard(name, len(data[name])).read_bytes() == data[name]
    url = f"{gcs_remote.url}/one.tser"
    with resolve(url, gcs_remote.storage_options, tmp_path, **options) as one:
        assert one.path.read_bytes() == data["one.tser"]
    # gcsfs's ``get_file`` once (its concurrent download asks the size), a single file's ours
    assert sorted(asked) == ["a.tser", "b.tser", "one.tser", "one.tser"]
    media = {name: gcs_remote.proxy.count("GET", gcs_remote.path(name)) for name in data}
    assert media == {"a.tser": 1, "b.tser": 1, "one.tser": 1}
    assert gcs_remote.proxy.count("HEAD", "/") == 0


def test_a_stalled_response_meets_the_deadline_and_is_retried(
    gcs_remote: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gcsfs sets no read timeout (aiohttp's 5 minutes a request): our deadline on the whole
    read is what ends a stalled answer, and the read is tried again."""
    data = os.urandom(PART // 2)
    gcs_remote.put("obj.bin", data)
    monkeypatch.setattr("torch_serialized.remote.store._DEADLINE_GRACE", 0.5)
    quick = dataclasses.replace(FAST, min_rate=1 << 20)  # a deadline of 0.53 s for the read
    store = RemoteStore(gcs_remote.url, gcs_remote.storage_options, retry=quick)
    assert store.info("obj.bin")["size"] == len(data)  # the session first: not part of the wait
    path = gcs_remote.path("obj.bin")
    gcs_remote.proxy.add_fault("delay", delay=4.0, count=1, path=path, method="GET")
    start = time.monotonic()
    assert store.download("obj.bin", tmp_path / "o", expected_size=len(data)).read_bytes() == data
    assert time.monotonic() - start < 3.0  # did not wait for the stalled answer
    assert gcs_remote.proxy.count("GET", path) == 2


@pytest.mark.parametrize("layout", ["shards", "single"])
def test_map_style_dataset_at_a_url_equals_the_local_pack(
    gcs_remote: Remote, stream_packs: dict[str, Path], tmp_path: Path, layout: str
) -> None:
    """test_remote_datasets.py's check of this counts GETs by name (NOT_GCS): here, every
    sample of both layouts."""
    local_pack = stream_packs[layout]
    upload(gcs_remote, local_pack)
    url = gcs_remote.url if layout == "shards" else f"{gcs_remote.url}/{local_pack.name}"
    remote_kw = {"storage_options": gcs_remote.storage_options, "cache_dir": tmp_path}
    local = ts.VOCSerializedDataset(local_pack, image_set="trainval", decode="none")
    ours = ts.VOCSerializedDataset(url, image_set="trainval", decode="none", **remote_kw)
    assert ours.root == url and len(ours) == len(local) > 0
    for i in range(len(local)):
        (a, ta), (b, tb) = ours[i], local[i]
        assert ta == tb and as_bytes(a) == as_bytes(b)


@pytest.mark.parametrize("form", ["shards", "single"])
def test_pack_to_a_url_then_append_reads_as_a_fresh_pack(
    gcs_remote: Remote, tmp_path: Path, form: str
) -> None:
    from torch_serialized.tools import make_synthetic_voc

    source = Source(tmp_path / "src", copy_of=make_synthetic_voc(tmp_path / "made", 16, year=YEAR))
    source.cut()
    url = f"{gcs_remote.url}/{out_name(form)}"
    options = gcs_remote.storage_options
    packed = ts.pack_voc(source.root, url, year=YEAR, storage_options=options, **PACK_FORMS[form])
    assert packed.num_samples == len(source.listed_now()) < len(source.listed())
    source.grow()
    result = ts.append_voc(source.root, url, storage_options=options, cache_dir=tmp_path / "c")
    assert result.url == url and result.num_samples == len(source.listed())
    assert result.added == len(source.listed()) - packed.num_samples > 0
    fresh = pack(source, tmp_path / "fresh", form)
    for image_set in ("train", "val"):
        at_url = ts.VOCSerializedDataset(
            url,
            image_set=image_set,
            decode="none",
            storage_options=options,
            cache_dir=tmp_path / "r",
        )
        local = ts.VOCSerializedDataset(fresh, image_set=image_set, decode="none")
        assert len(at_url) == len(local) > 0
        for i in range(len(local)):
            (a, ta), (b, tb) = at_url[i], local[i]
            assert ta == tb and as_bytes(a) == as_bytes(b)
