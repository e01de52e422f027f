"""Packs at URLs read end to end through real loopback servers (HTTP with Range, moto S3)
and the fault proxy: every reader gives what the same pack gives locally."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
from _remote_cases import NOT_GCS
from torch.utils.data import DataLoader

import torch_serialized as ts
from torch_serialized.container.shards import open_pack
from torch_serialized.errors import ChecksumError, RemoteNotFoundError

if TYPE_CHECKING:
    from remote_fixtures import Remote

pytest_plugins = ["remote_fixtures"]

HERE = Path(__file__).parent
#: for tests of our own logic above the transfer layer, which both servers exercise alike
ONE_SERVER = pytest.mark.parametrize("remote", ["http"], indirect=True)
REPO = HERE.parent


def upload(remote: Remote, pack: Path) -> None:
    """Put a local pack (a shard folder's files, or one file) under ``remote``'s folder."""
    files = sorted(pack.iterdir()) if pack.is_dir() else [pack]
    files.sort(key=lambda f: f.name == "manifest.json")  # manifest last
    if remote.kind == "s3":  # one filesystem for all the files (a session costs ~0.5 s)
        from remote_fixtures import BUCKET, direct_s3  # the plugin, loaded by then

        fs = direct_s3(remote.served.server.url)
        for f in files:
            fs.put_file(str(f), f"{BUCKET}/{remote.prefix}/{f.name}")
        return
    for f in files:
        remote.put(f.name, f.read_bytes())


def cached_bytes(folder: Path) -> int:
    """Bytes of the pack files in a cache folder; a file evicted (by a prefetch thread) between
    the listing and its ``stat`` counts nothing."""
    total = 0
    for path in folder.glob("*.tser"):
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
    return total


def shard_names(pack: Path) -> list[str]:
    return [s["file"] for s in json.loads((pack / "manifest.json").read_bytes())["shards"]]


def digest(image: torch.Tensor) -> str:
    return hashlib.blake2b(image.numpy().tobytes(), digest_size=8).hexdigest()


def drop(target: object) -> int:
    return 0


def stream(
    path: Any, loader_workers: int = 2, **kwargs: Any
) -> tuple[ts.VOCSerializedIterableDataset, Iterator[Any]]:
    ds = ts.VOCSerializedIterableDataset(
        path,
        "trainval",
        shuffle=True,
        seed=3,
        block_size=4,
        shuffle_buffer=8,
        decode="none",
        transform=digest,
        target_transform=drop,
        **kwargs,
    )
    return ds, iter(DataLoader(ds, batch_size=None, num_workers=loader_workers))


#: the prefix holding ``stream_packs["shards"]`` on each server, uploaded once per session
_UPLOADED: dict[str, str] = {}


@pytest.fixture
def served(remote: Remote, stream_packs: dict[str, Path]) -> Remote:
    """``stream_packs["shards"]`` on the server (shared by the tests that only read it)."""
    if remote.kind not in _UPLOADED:
        upload(remote, stream_packs["shards"])
        _UPLOADED[remote.kind] = remote.prefix
    return dataclasses.replace(remote, prefix=_UPLOADED[remote.kind])


@pytest.fixture
def own_copy(remote: Remote, stream_packs: dict[str, Path]) -> Remote:
    """``stream_packs["shards"]`` in this test's own folder, for a test that changes it."""
    upload(remote, stream_packs["shards"])
    return remote


@NOT_GCS
def test_map_style_dataset_from_a_url_equals_the_local_pack(
    served: Remote, stream_packs: dict[str, Path], tmp_path: Path
) -> None:
    local = ts.VOCSerializedDataset(stream_packs["shards"], image_set="trainval")
    ours = ts.VOCSerializedDataset(
        served.url, image_set="trainval", storage_options=served.storage_options, cache_dir=tmp_path
    )
    assert ours.root == served.url
    names = shard_names(stream_packs["shards"])
    # the manifest and catalog at open, no shard yet
    assert served.proxy.count("GET", served.path("manifest.json")) == 1
    assert served.proxy.count("GET", "catalog-") == 1
    assert all(served.proxy.count("GET", served.path(n)) == 0 for n in names)
    assert len(ours) == len(local)
    ours[len(ours) - 1]  # first touch of the last shard downloads it, and only it
    touched = [n for n in names if served.proxy.count("GET", served.path(n))]
    assert len(touched) == 1
    for i in range(len(local)):
        (a, ta), (b, tb) = ours[i], local[i]
        assert ta == tb
        assert a.tobytes() == b.tobytes()
    assert all(served.proxy.count("GET", served.path(n)) <= 1 for n in names)  # downloaded once


def test_a_single_file_pack_at_a_url(
    remote: Remote, stream_packs: dict[str, Path], tmp_path: Path
) -> None:
    single = stream_packs["single"]
    upload(remote, single)
    url = f"{remote.url}/{single.name}"
    with pytest.raises(RemoteNotFoundError, match="manifest.json"):
        open_pack(
            remote.url + "/missing", storage_options=remote.storage_options, cache_dir=tmp_path
        )
    ours = ts.SerializedDataset(url, storage_options=remote.storage_options, cache_dir=tmp_path)
    local = ts.SerializedDataset(single)
    assert len(ours) == len(local)
    for i in (0, len(local) // 2, len(local) - 1):
        a, b = ours[i], local[i]
        assert a["id"] == b["id"] and a["target"] == b["target"]
        assert np.array_equal(a["image"], b["image"])


def test_iterable_from_a_url_equals_the_local_pack(
    served: Remote, stream_packs: dict[str, Path], tmp_path: Path
) -> None:
    _, it = stream(stream_packs["shards"])
    want = [d for d, _ in it]
    _, it = stream(served.url, storage_options=served.storage_options, cache_dir=tmp_path)
    assert [d for d, _ in it] == want


def test_a_stream_of_a_local_pack_and_a_url_equals_the_two_local_packs(
    served: Remote, stream_packs: dict[str, Path], tmp_path: Path
) -> None:
    """Sources mixed: a pack at a URL beside a local one reads as the two local packs."""
    local = [(stream_packs["single"], "train"), (stream_packs["shards"], "val")]
    _, it = stream(local)
    want = [d for d, _ in it]
    mixed = [(stream_packs["single"], "train"), (served.url, "val")]
    _, it = stream(mixed, storage_options=served.storage_options, cache_dir=tmp_path)
    assert [d for d, _ in it] == want
    options = {"storage_options": served.storage_options, "cache_dir": tmp_path}
    maps = [ts.VOCSerializedDataset(s, image_set="trainval", **options) for s in (local, mixed)]
    assert len(maps[0]) == len(maps[1]) > 0
    assert all(maps[0][i][1] == maps[1][i][1] for i in range(len(maps[0])))  # map-style too


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata 0.11
def test_resume_works_across_a_url_and_a_local_copy(
    served: Remote, stream_packs: dict[str, Path], tmp_path: Path
) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    local = stream_packs["shards"]
    remote_kw = {"storage_options": served.storage_options, "cache_dir": tmp_path}
    _, it = stream(local)
    want = [d for d, _ in it]
    for first, second in ((served.url, local), (local, served.url)):
        a, _ = stream(first, **(remote_kw if first == served.url else {}))
        loader = stateful.StatefulDataLoader(a, batch_size=None, num_workers=2)
        got = []
        for d, _ in loader:
            got.append(d)
            if len(got) == 13:
                state = loader.state_dict()
                break
        b, _ = stream(second, **(remote_kw if second == served.url else {}))
        loader = stateful.StatefulDataLoader(b, batch_size=None, num_workers=2)
        loader.load_state_dict(state)
        got.extend(d for d, _ in loader)
        assert got == want


@ONE_SERVER
def test_every_reader_of_the_issue_takes_a_url(
    served: Remote, stream_packs: dict[str, Path], tmp_path: Path
) -> None:
    kw = {"storage_options": served.storage_options, "cache_dir": tmp_path}
    seg = ts.VOCSerializedSegmentation(served.url, image_set="trainval", **kw)
    local = ts.VOCSerializedSegmentation(stream_packs["shards"], image_set="trainval")
    assert len(seg) == len(local)
    assert np.array_equal(np.asarray(seg[0][1]), np.asarray(local[0][1]))
    reader = ts.open_pack(served.url, **kw)
    assert (
        reader.url == served.url
        and reader.num_records == open_pack(stream_packs["shards"]).num_records
    )
    assert reader.verify() == []


def test_a_damaged_shard_on_the_server_downloads_twice_then_raises(
    own_copy: Remote, stream_packs: dict[str, Path], tmp_path: Path
) -> None:
    served = own_copy
    name = shard_names(stream_packs["shards"])[0]
    data = bytearray((stream_packs["shards"] / name).read_bytes())
    data[4096] ^= 0xFF  # a record's byte: size and metadata checksum still match
    served.put(name, bytes(data))
    ds = ts.VOCSerializedDataset(
        served.url, image_set="trainval", storage_options=served.storage_options, cache_dir=tmp_path
    )
    first = int(np.flatnonzero(ds.records == 0)[0])
    with pytest.raises(ChecksumError) as info:
        ds[first]
    assert served.url in str(info.value) and name in str(info.value)
    assert served.proxy.count("GET", served.path(name)) == 2
    assert not [p for p in Path(ds.pack.path).iterdir() if p.name == name or "partial" in p.name]


def test_messages_about_a_pack_at_a_url_name_the_url(served: Remote, tmp_path: Path) -> None:
    """The user gave a URL: a message names it, never the cache file it was copied to."""
    opened = {"storage_options": served.storage_options, "cache_dir": tmp_path}
    with pytest.raises(ValueError, match="image_set 'nope' is not in ") as info:
        ts.VOCSerializedDataset(served.url, image_set="nope", **opened)
    assert served.url in str(info.value) and str(tmp_path) not in str(info.value)
    ds = ts.VOCSerializedDataset(served.url, image_set="trainval", **opened)
    with pytest.raises(IndexError) as info:
        ds[len(ds)]
    assert f"of {served.url} has {len(ds)} samples" in str(info.value)
    assert ds.pack.where(0).startswith(f"{served.url}: record 0 (id ")  # per-sample errors
    # errors found in a shard or the catalog name the manifest at the URL, not the cached copy
    expected = ds.pack.reader._expected
    assert all(e is not None and e.member.endswith(f"{served.url}/manifest.json") for e in expected)


@ONE_SERVER
def test_a_single_file_with_contradicting_columns_at_a_url_names_the_url(
    remote: Remote, stream_packs: dict[str, Path], tmp_path: Path
) -> None:
    """Refused at open (docs/FORMAT.md, "Record columns"), naming the URL the user gave,
    not the cached copy."""
    from _container_helpers import rebuild_pack

    def clear_flags(contents: Any) -> None:
        contents.arrays["records"]["flags"][1] = 0  # record 1 keeps its annotation bytes

    bad = rebuild_pack(stream_packs["single"], tmp_path / "bad.tser", clear_flags)
    upload(remote, bad)
    with pytest.raises(ts.FormatError, match="record 1's columns contradict") as info:
        ts.VOCSerializedDataset(
            f"{remote.url}/bad.tser",
            storage_options=remote.storage_options,
            cache_dir=tmp_path / "cache",
        )
    assert str(info.value).startswith(f"{remote.url}/bad.tser: ")


@ONE_SERVER
def test_a_checked_read_of_a_damaged_cached_copy_says_to_clear_the_cache(
    remote: Remote, stream_packs: dict[str, Path], tmp_path: Path
) -> None:
    """A pack at a URL is checked in full when downloaded: a record failing its checksum
    later means the cached copy changed, which clearing the cache mends (re-packing would
    not)."""
    single = stream_packs["single"]
    upload(remote, single)
    url = f"{remote.url}/{single.name}"
    ds = ts.VOCSerializedDataset(
        url,
        image_set="trainval",
        checked=True,
        storage_options=remote.storage_options,
        cache_dir=tmp_path,
        decode="none",
    )
    record = int(ds.records[0])
    shard, local = ds.pack.reader.locate(record)
    offset = int(shard.index_rows([local])["offset"][0, 0])
    with open(ds.pack.path, "r+b") as f:  # the cached copy, changed under the reader
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))
    with pytest.raises(ChecksumError, match="the cached copy is damaged: clear it") as info:
        ds[0]
    assert str(info.value).startswith(f"{url}: record {record} (id ")


@ONE_SERVER
def test_a_damaged_single_file_pack_on_the_server_downloads_twice_then_raises(
    remote: Remote, stream_packs: dict[str, Path], tmp_path: Path
) -> None:
    single = stream_packs["single"]
    data = bytearray(single.read_bytes())
    data[4096] ^= 0xFF  # a record's byte: size and footer still match
    remote.put(single.name, bytes(data))
    with pytest.raises(ChecksumError, match="the file on the server is damaged") as info:
        open_pack(
            f"{remote.url}/{single.name}",
            storage_options=remote.storage_options,
            cache_dir=tmp_path,
        )
    assert single.name in str(info.value)
    # the file twice (its identity asked before and after: not replaced meanwhile, damaged)
    assert remote.proxy.count("GET", remote.path(single.name)) == 2
    assert list(tmp_path.rglob("*.tser")) == [] and list(tmp_path.rglob("*.partial")) == []


def test_a_missing_pack_names_the_url_and_what_to_check(remote: Remote, tmp_path: Path) -> None:
    with pytest.raises(RemoteNotFoundError) as info:
        ts.VOCSerializedDataset(
            remote.url + "/nothing-here",
            storage_options=remote.storage_options,
            cache_dir=tmp_path,
        )
    assert "nothing-here" in str(info.value) and "Check" in str(info.value)


def test_an_epoch_through_faults_equals_the_local_pack(
    served: Remote, stream_packs: dict[str, Path], tmp_path: Path
) -> None:
    _, it = stream(stream_packs["shards"])
    want = [d for d, _ in it]
    names = shard_names(stream_packs["shards"])
    proxy = served.proxy
    proxy.configure(latency=0.005)
    proxy.add_fault("drop", count=1, path=names[1])
    proxy.add_fault("status", status=503, count=2, path=names[2])
    proxy.add_fault("truncate", count=1, path=names[3], after_bytes=100)
    proxy.add_fault("status", status=429, count=1, path=names[4])
    _, it = stream(served.url, storage_options=served.storage_options, cache_dir=tmp_path)
    assert [d for d, _ in it] == want
    faults = proxy.stats()["faults"]
    assert faults.get("drop") == 1 and faults.get("truncate") == 1 and faults.get("status") == 3


def run_ranks(specs: list[dict[str, Any]]) -> list[str]:
    """Run ``tests/_remote_rank.py`` once per spec, at the same time; the digests they saw."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "_remote_rank.py"), json.dumps(spec)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for spec in specs
    ]
    seen = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        seen.extend(json.loads(out))
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("remote", ["s3", "http"], indirect=True)
def test_two_ranks_with_two_workers_share_one_cache_and_download_each_shard_once(
    served: Remote, stream_packs: dict[str, Path], tmp_path: Path
) -> None:
    # Forked workers: spawned ones cost 50 s more here (a torch import each); spawn has its own
    # test below, with one worker.
    seen = run_ranks(
        [
            {
                "url": served.url,
                "storage_options": served.storage_options,
                "cache_dir": str(tmp_path),
                "rank": rank,
                "world_size": 2,
            }
            for rank in (0, 1)
        ]
    )
    local = ts.VOCSerializedDataset(stream_packs["shards"], image_set="trainval", decode="none")
    assert set(seen) == {digest(local[i][0]) for i in range(len(local))}
    for name in shard_names(stream_packs["shards"]):  # its tail's ranged GET, then its body
        assert served.proxy.count("GET", served.path(name)) <= 2, name
    assert served.proxy.count("GET", "catalog-") == 1


@pytest.mark.slow
@pytest.mark.parametrize("remote", ["s3"], indirect=True)
def test_a_spawned_worker_streams_a_pack_at_a_url(
    served: Remote, stream_packs: dict[str, Path], tmp_path: Path
) -> None:
    # What spawn adds over fork: the dataset, its storage options (S3 endpoint and keys) and
    # the cache reach the worker through pickle, and the worker opens the pack afresh.
    spec = {
        "url": served.url,
        "storage_options": served.storage_options,
        "cache_dir": str(tmp_path),
        "rank": 0,
        "world_size": 1,
        "workers": 1,
        "start": "spawn",
    }
    seen = run_ranks([spec])
    local = ts.VOCSerializedDataset(stream_packs["shards"], image_set="trainval", decode="none")
    assert sorted(seen) == sorted(digest(local[i][0]) for i in range(len(local)))


@ONE_SERVER
def test_a_bounded_cache_keeps_a_stream_within_its_limit(
    served: Remote, stream_packs: dict[str, Path], tmp_path: Path
) -> None:
    """A block here spans up to three shards: with room for four, the stream holds its block's
    and prefetches ahead only what fits."""
    pack = stream_packs["shards"]
    sizes = [(pack / n).stat().st_size for n in shard_names(pack)]
    fixed = sum(f.stat().st_size for f in pack.iterdir() if f.name not in shard_names(pack))
    limit = fixed + 4 * max(sizes)
    _, it = stream(pack, loader_workers=0)
    want = [d for d, _ in it]
    ds, it = stream(
        served.url,
        loader_workers=0,
        storage_options=served.storage_options,
        cache_dir=tmp_path,
        cache_limit_bytes=limit,
        prefetch=1,
    )
    got = []
    with warnings.catch_warnings(record=True) as seen:  # raised in a download thread, else
        warnings.simplefilter("always")
        for d, _ in it:
            got.append(d)
            cached = cached_bytes(Path(ds.pack.path))
            assert cached <= limit
    assert not seen  # no CacheLimitWarning: a block over three shards and two ahead needed 5
    assert got == want
    assert len(list(Path(ds.pack.path).glob("shard-*.tser"))) < len(sizes)


@ONE_SERVER
def test_the_workers_of_a_rank_share_the_cache_limit(
    served: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each DataLoader worker prefetches ahead within its share of ``cache_limit_bytes``: with
    the whole of it each, two workers held up to twice what it has room for."""
    from torch_serialized.data import pipeline, topology

    budgets: list[int | None] = []
    real = pipeline.ShardWindow.__init__

    def init(self: Any, reader: Any, blocks: Any, ahead: int, budget: Any, *rank: Any) -> None:
        budgets.append(budget)
        real(self, reader, blocks, ahead, budget, *rank)

    monkeypatch.setattr(pipeline.ShardWindow, "__init__", init)
    worker = types.SimpleNamespace(id=1, num_workers=2)
    monkeypatch.setattr(topology, "get_worker_info", lambda: worker)
    ds, _ = stream(
        served.url,
        storage_options=served.storage_options,
        cache_dir=tmp_path,
        cache_limit_bytes=10 << 20,
    )
    assert 0 < len(list(ds)) < len(ds)  # worker 1's part of the stream, read in this process
    whole = ds.pack.reader.shard_budget()
    assert whole is not None and budgets == [whole // 2]


@ONE_SERVER
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_workers_window_follows_its_rank_in_dataloader_order(
    served: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shuffle: bool
) -> None:
    """Each worker's ``ShardWindow`` sees every block of its rank, in the order the DataLoader
    reads them (workers in turn), its own blocks among them where they are read."""
    from torch_serialized.data import pipeline, topology

    seen: list[Any] = []
    real = pipeline.ShardWindow.__init__

    def init(self: Any, reader: Any, blocks: Any, ahead: int, budget: Any, rank: Any) -> None:
        seen.append((blocks, ahead, rank))
        real(self, reader, blocks, ahead, budget, rank)

    monkeypatch.setattr(pipeline.ShardWindow, "__init__", init)
    worker = types.SimpleNamespace(id=1, num_workers=2)
    monkeypatch.setattr(topology, "get_worker_info", lambda: worker)
    ds = ts.VOCSerializedIterableDataset(
        served.url,
        "trainval",
        shuffle=shuffle,
        block_size=4,
        storage_options=served.storage_options,
        cache_dir=tmp_path,
    )
    assert len(list(ds)) < len(ds)  # worker 1's part, read in this process
    [(own, ahead, (order, at))] = seen
    assert ahead == 2 * ds.prefetch
    records = ds._parts[0].records
    both = [ds.blocks(w, 2) for w in range(2)]
    expected = [both[w][j] for w, j in pipeline.rank_order(both)]
    assert [o.tolist() for o in order] == [records[b].tolist() for b in expected]
    assert [order[i].tolist() for i in at] == [o.tolist() for o in own]
    assert [o.tolist() for o in own] == [records[b].tolist() for b in both[1]]


@pytest.mark.slow
def test_pack_voc_to_a_url_then_a_repack_keeps_an_open_reader_working(
    s3_remote: Remote, voc40: Path, voc8: Path, tmp_path: Path
) -> None:
    url, options = s3_remote.url + "/voc", s3_remote.storage_options
    result = ts.pack_voc(voc40, url, max_samples_per_shard=9, storage_options=options)
    assert result.url == url and not Path(result.path).exists()  # staging removed
    log = [line for line in s3_remote.proxy.stats()["log"] if line.startswith("PUT")]
    assert log and "manifest.json" in log[-1]  # uploaded last
    local = ts.pack_voc(voc40, tmp_path / "local", max_samples_per_shard=9).path
    old = ts.VOCSerializedDataset(
        url, image_set="trainval", storage_options=options, cache_dir=tmp_path
    )
    want = ts.VOCSerializedDataset(local, image_set="trainval")
    old[0]  # one shard cached, the others not yet
    early = ts.VOCSerializedDataset(
        url, image_set="trainval", storage_options=options, cache_dir=tmp_path / "e"
    )
    early[0]  # its own cache: its other shards are read after the prune below
    ts.pack_voc(voc8, url, max_samples_per_shard=3, storage_options=options)
    assert len(old) == len(want)
    for i in range(len(want)):  # the old pack's shards are still there
        assert old[i][1] == want[i][1]
    new = ts.VOCSerializedDataset(
        url, image_set="trainval", storage_options=options, cache_dir=tmp_path
    )
    v8 = ts.VOCSerializedDataset(ts.pack_voc(voc8, tmp_path / "v8").path, image_set="trainval")
    assert [new[i][1] for i in range(len(new))] == [v8[i][1] for i in range(len(v8))]
    assert new.pack.reader.manifest_sha256 != old.pack.reader.manifest_sha256
    assert new.pack.path != old.pack.path  # a fresh cache folder: no stale shards mix in
    stale = ts.prune_remote(url, options, dry_run=True)
    assert len(stale) == len(shard_names(local)) + 1  # the old shards and catalog
    assert ts.prune_remote(url, options) == stale
    assert ts.prune_remote(url, options) == []
    # a reader of the pruned pack is told the pack was replaced, not to check the bucket name
    with pytest.raises(ts.FileChangedError, match=f"{url} was replaced after it was opened"):
        early[len(early) - 1]
    fresh = ts.VOCSerializedDataset(
        url, image_set="trainval", storage_options=options, cache_dir=tmp_path
    )
    assert [fresh[i][1] for i in range(len(fresh))] == [new[i][1] for i in range(len(new))]


def test_a_single_file_pack_written_to_a_url(s3_remote: Remote, voc8: Path, tmp_path: Path) -> None:
    url, options = s3_remote.url + "/voc8.tser", s3_remote.storage_options
    ts.pack_voc(voc8, url, storage_options=options)
    ours = ts.VOCSerializedDataset(
        url, image_set="trainval", storage_options=options, cache_dir=tmp_path
    )
    want = ts.VOCSerializedDataset(
        ts.pack_voc(voc8, tmp_path / "v8.tser").path, image_set="trainval"
    )
    assert [ours[i][1] for i in range(len(ours))] == [want[i][1] for i in range(len(want))]


@ONE_SERVER
def test_each_rank_downloads_only_the_shards_it_reads(
    served: Remote, stream_packs: dict[str, Path], tmp_path: Path
) -> None:
    pack = stream_packs["shards"]
    names = shard_names(pack)
    reader = open_pack(pack)
    for rank in (0, 1):
        ds = ts.VOCSerializedIterableDataset(
            served.url,
            "trainval",
            rank=rank,
            world_size=2,
            decode="none",
            storage_options=served.storage_options,
            cache_dir=tmp_path / f"rank{rank}",
        )
        read = {int(r) for block in ds.blocks() for r in ds.records[block]}
        needed = {names[int(np.searchsorted(reader.starts, r, side="right")) - 1] for r in read}
        served.proxy.reset()
        assert len(list(ds)) == len(read)
        fetched = {n for n in names if served.proxy.count("GET", served.path(n))}
        assert fetched == needed and len(needed) < len(names)


def test_access_denied_names_the_url_and_what_to_check(
    served: Remote, stream_packs: dict[str, Path], tmp_path: Path
) -> None:
    served.proxy.add_fault("status", status=403, count=None)
    with pytest.raises(ts.RemoteAccessError) as info:
        ts.VOCSerializedDataset(
            served.url, storage_options=served.storage_options, cache_dir=tmp_path
        )
    assert "manifest.json" in str(info.value) and "credentials" in str(info.value)
    assert served.proxy.stats()["faults"]["status"] == 1  # not retried


@ONE_SERVER
def test_close_releases_the_shards_but_not_the_catalog(
    served: Remote, stream_packs: dict[str, Path], tmp_path: Path
) -> None:
    reader = open_pack(served.url, storage_options=served.storage_options, cache_dir=tmp_path)
    assert reader.verify() == []  # every shard fetched and held
    assert reader.remote is not None and reader.manifest is not None
    catalog = reader.manifest.catalog
    assert catalog is not None
    assert len(reader.remote.held()) == reader.num_shards + 2
    reader.close()
    assert reader.remote.held() == sorted(["manifest.json", catalog.file])
    assert reader.verify() == []  # fetched again (from the cache: no new download)
    assert served.proxy.count("GET", "shard-") == reader.num_shards


def test_pack_voc_to_a_url_uploads_the_manifest_after_every_file_it_names(
    voc8: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest is the commit point of a pack at a URL: when it goes up, every shard and
    the catalog it names are there already, however slow their uploads were."""
    import time

    from torch_serialized.container import spec as fmt
    from torch_serialized.remote import upload as uploads
    from torch_serialized.remote.store import RemoteStore

    dest = tmp_path / "dest"
    real = uploads.upload_file
    there_at_manifest: list[set[str]] = []

    def upload_file(store: RemoteStore, local: str | os.PathLike[str], key: str = "") -> None:
        if key == fmt.MANIFEST_NAME:
            there_at_manifest.append({p.name for p in dest.glob("*.tser")})
        else:
            time.sleep(0.2)  # a slow shard or catalog upload
        real(store, local, key)

    monkeypatch.setattr(uploads, "upload_file", upload_file)
    ts.pack_voc(voc8, dest.as_uri(), max_samples_per_shard=3)
    manifest = open_pack(dest).manifest
    assert manifest is not None and len(manifest.shards) == 3
    assert there_at_manifest == [set(manifest.files())]
