"""Atomic output: the destination holds nothing, the previous pack or the new one, never a part.

Failures inside the writer, a SIGKILL at random moments, a crash between the two renames that
replace a shard folder, and the stale temporaries such crashes leave.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _container_helpers import (
    COLUMNS,
    FIELDS,
    FORMS,
    check_pack,
    listing,
    payload,
    run_python,
    write_pack,
)
from _reliability_helpers import (
    PACK_FORMS,
    dead_pid,
    out_name,
    pinned_identity,
    run_child,
    snapshot,
)

from torch_serialized.container import fileio
from torch_serialized.container.shards import open_pack
from torch_serialized.container.shardwriter import PackWriter
from torch_serialized.errors import WriteError
from torch_serialized.voc.pack import pack_voc


@pytest.fixture(autouse=True)
def _same_identity() -> Any:
    """These tests compare a pack with one written earlier byte for byte: pin the pack id and
    file-name token, which are random per write otherwise."""
    with pinned_identity():
        yield


# -- the helpers themselves ---------------------------------------------------------------------
def test_temporary_names_are_hidden_siblings_that_name_their_process(tmp_path: Path) -> None:
    final = tmp_path / "out.tser"
    temp = fileio.temp_sibling(final)
    assert temp.parent == tmp_path and temp.name.startswith(f".out.tser.tmp-{os.getpid()}-")
    assert fileio.temp_sibling(final) != temp
    assert fileio.temp_sibling(final, "old").name.startswith(f".out.tser.old-{os.getpid()}-")


def test_replace_file_leaves_the_old_file_or_the_new_one(tmp_path: Path) -> None:
    target = tmp_path / "a.txt"
    target.write_bytes(b"old")
    fileio.replace_file(target, b"new")
    assert target.read_bytes() == b"new" and listing(tmp_path) == ["a.txt"]

    with pytest.raises(TypeError):  # fails after the temporary was created
        fileio.replace_file(target, "not bytes")  # type: ignore[arg-type]
    assert target.read_bytes() == b"new" and listing(tmp_path) == ["a.txt"]


def test_output_commits_and_removes_its_scratch(tmp_path: Path) -> None:
    final = tmp_path / "out"
    output = fileio.AtomicOutput(final, folder=True)
    scratch = output.scratch()
    (output.path / "f").write_bytes(b"x")
    (scratch / "chunk").write_bytes(b"y")
    output.commit()
    assert listing(tmp_path) == ["out"] and (final / "f").read_bytes() == b"x"

    again = fileio.AtomicOutput(final, folder=True)
    again.scratch()
    again.abort()
    assert listing(tmp_path) == ["out"] and (final / "f").read_bytes() == b"x"


def test_stale_temporaries_of_dead_processes_only_are_removed(tmp_path: Path) -> None:
    final = tmp_path / "out.tser"
    dead, alive = dead_pid(), os.getppid()
    names = [
        f".out.tser.tmp-{dead}-00000000",  # a killed writer's file
        f".out.tser.tmp-{alive}-00000000",  # a live writer's file
        f".out.tser.tmp-{os.getpid()}-00000000",  # this process's own
        f".out.tser.bak-{dead}-00000000",  # not ours to judge
        ".other.tmp-1-00000000",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    fileio.clean_stale(final)
    assert listing(tmp_path) == sorted(names[1:])


@pytest.mark.parametrize("form", FORMS)
def test_exception_mid_write_leaves_nothing(tmp_path, form):
    out = tmp_path / "out.tser"
    with pytest.raises(RuntimeError, match="boom"), PackWriter(out, FIELDS, **FORMS[form]) as w:
        for i in range(20):
            w.add([payload(i, 0, 100), b""])
        raise RuntimeError("boom")
    assert listing(tmp_path) == []


@pytest.mark.parametrize("form", FORMS)
def test_failure_at_close_leaves_nothing(tmp_path, form):
    out = tmp_path / "out.tser"
    with pytest.raises(TypeError), PackWriter(out, FIELDS, **FORMS[form]) as w:
        w.add([b"a", b"b"])
        w.close({"not json": object()})
    assert listing(tmp_path) == []


@pytest.mark.parametrize("form", FORMS)
def test_leaving_the_block_without_close_commits(tmp_path, form):
    out = tmp_path / "out"
    with PackWriter(out, FIELDS, **FORMS[form]) as w:
        w.add([b"a", b"b"])
    assert listing(tmp_path) == ["out"]
    assert bytes(open_pack(out).field(0, 1)) == b"b"


@pytest.mark.parametrize("old_form", FORMS)
@pytest.mark.parametrize("new_form", FORMS)
def test_previous_pack_kept_on_failure_replaced_on_success(tmp_path, old_form, new_form):
    out = write_pack(tmp_path / "out", 30, **FORMS[old_form])
    with (
        pytest.raises(KeyboardInterrupt),
        PackWriter(out, FIELDS, columns=COLUMNS, **FORMS[new_form]) as w,
    ):
        for i in range(10):
            w.add([b"new", b"new"], (i, 0.0))
        raise KeyboardInterrupt
    assert listing(tmp_path) == ["out"]
    check_pack(open_pack(out), 30)
    assert open_pack(out).verify() == []

    write_pack(out, 12, seed=50, **FORMS[new_form])
    assert listing(tmp_path) == ["out"]
    assert out.is_dir() == (new_form == "shards")
    check_pack(open_pack(out), 12, seed=50)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
@pytest.mark.parametrize("over", [False, True], ids=["new", "over-a-pack"])
@pytest.mark.parametrize("form", FORMS)
def test_every_file_is_fsynced_before_the_rename_that_publishes_it(
    tmp_path, form, over, monkeypatch
):
    """Durability after a power loss: each file (a single file; every shard, the catalog and
    the manifest of a folder) and the temporary folder itself are fsynced before the rename
    that puts the output in place, and the parent folder after it (its new entry)."""
    if over:
        write_pack(tmp_path / "out", 3, **FORMS[form])
    events: list[tuple[str, str] | tuple[str, str, str]] = []
    fsync, replace = os.fsync, os.replace

    def record_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def record_replace(src: Any, dst: Any) -> None:
        events.append(("replace", os.fspath(src), os.fspath(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "replace", record_replace)
    out = write_pack(tmp_path / "out", 20, **FORMS[form])
    monkeypatch.undo()
    publish = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(out)]
    assert len(publish) == 1
    (at,) = publish
    temp = events[at][1]
    synced_before = {e[1] for e in events[:at] if e[0] == "fsync"}
    files = [temp] if form == "single" else [temp, *(f"{temp}/{f.name}" for f in out.iterdir())]
    assert len(files) == (1 if form == "single" else 1 + 3 + 1 + 1)  # 3 shards, catalog, manifest
    assert set(files) <= synced_before
    assert ("fsync", str(tmp_path)) in events[at + 1 :]


SLOW_WRITER = """
    import time
    single = PackWriter(sys.argv[1] + "/single.tser", ["a"])
    (single.scratch() / "chunk-000000").write_bytes(bytes(1000))  # as pack workers leave it
    shards = PackWriter(sys.argv[1] + "/shards", ["a"], max_records_per_shard=2)
    for i in range(100000):
        single.add([bytes(1000)])
        shards.add([bytes(1000)])
        if i == 5:
            print("started", flush=True)
        time.sleep(0.01)
"""


def test_sigkill_mid_write_leaves_no_output_and_stale_temp_is_removed(tmp_path):
    proc = run_python(SLOW_WRITER, str(tmp_path))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == "started\n", proc.stderr.read() if proc.stderr else ""
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    left = listing(tmp_path)
    assert sorted(name.split("-")[0] for name in left) == [
        ".shards.tmp",
        ".single.tser.tmp",  # the output being written
        ".single.tser.tmp",  # and its scratch folder
    ]
    assert all(f"-{proc.pid}-" in name for name in left)
    assert not (tmp_path / "single.tser").exists() and not (tmp_path / "shards").exists()

    for name, limits in (("single.tser", {}), ("shards", {"max_records_per_shard": 2})):
        with PackWriter(tmp_path / name, ["a"], **limits) as w:
            assert not any(n.startswith(f".{name}.tmp-{proc.pid}-") for n in listing(tmp_path))
            w.add([b"fresh"])
            w.close()
    assert listing(tmp_path) == ["shards", "single.tser"]
    assert bytes(open_pack(tmp_path / "shards").field(0, 0)) == b"fresh"


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("form", PACK_FORMS)
def test_pack_killed_at_random_moments_keeps_previous_or_new_pack(tmp_path, voc40, voc8, form):
    options = PACK_FORMS[form]
    name = out_name(form)
    ref = tmp_path / "ref"
    ref.mkdir()
    previous = snapshot(pack_voc(voc8, ref / f"previous-{name}", year="2007", **options).path)
    new = snapshot(pack_voc(voc40, ref / name, year="2007", **options).path)
    assert previous and new and previous != new

    rng = random.Random(f"kill-{form}")
    delays = [0.05, *(rng.uniform(0.05, 1.5) for _ in range(3))]
    outcomes = []
    for run, delay in enumerate(delays):
        folder = tmp_path / f"run{run}"
        folder.mkdir()
        out = folder / name
        if form == "shards":
            shutil.copytree(ref / f"previous-{name}", out)
        else:
            shutil.copyfile(ref / f"previous-{name}", out)
        # 40 images, 25 ms each: the pack writes for about a second after "started"
        proc = run_child("slow_pack", str(voc40), str(out), json.dumps(options), "0.025")
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line == "started\n", proc.stderr.read() if proc.stderr else ""
            time.sleep(delay)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
        state = snapshot(out)
        left = [n for n in listing(folder) if n != name]
        assert state in (previous, new), f"kill after {delay:.2f}s left a partial pack"
        assert all(
            n.startswith((f".{name}.tmp-{proc.pid}-", f".{name}.old-{proc.pid}-")) for n in left
        )
        outcomes.append((delay, "previous" if state == previous else "new", left))

        result = pack_voc(voc40, out, year="2007", **options)  # the next pack cleans up
        assert listing(folder) == [name]
        assert snapshot(result.path) == new
        assert len(open_pack(out)) == 40
    assert any(kept == "previous" and left for _, kept, left in outcomes), outcomes


def make_crash_state(tmp_path: Path, voc8: Path, voc40: Path, old_form: str) -> tuple[Path, int]:
    """The folder a writer killed between its two renames leaves: the previous pack moved to
    ``.voc.old-PID-*``, the complete new one still at ``.voc.tmp-PID-*``, nothing at ``voc``."""
    out = tmp_path / "voc"
    pack_voc(voc8, out, year="2007", **PACK_FORMS[old_form])
    pid = dead_pid()
    os.replace(out, tmp_path / f".voc.old-{pid}-0badc0de")
    staging = tmp_path / "staging"
    staging.mkdir()
    new = pack_voc(voc40, staging / "voc", year="2007", **PACK_FORMS["shards"]).path
    os.replace(new, tmp_path / f".voc.tmp-{pid}-0ddba11a")
    staging.rmdir()
    return out, pid


@pytest.mark.parametrize("old_form", PACK_FORMS)
def test_crash_between_the_two_renames_restores_the_previous_pack(tmp_path, voc8, voc40, old_form):
    ref = tmp_path / "ref"
    ref.mkdir()
    previous = snapshot(pack_voc(voc8, ref / "voc", year="2007", **PACK_FORMS[old_form]).path)
    work = tmp_path / "work"
    work.mkdir()
    out, _ = make_crash_state(work, voc8, voc40, old_form)
    assert not out.exists()

    fileio.clean_stale(out)
    assert listing(work) == ["voc"]
    assert snapshot(out) == previous
    assert len(open_pack(out)) == 8

    result = pack_voc(voc40, out, year="2007", **PACK_FORMS["shards"])
    assert listing(work) == ["voc"] and len(open_pack(result.path)) == 40


def test_crash_after_the_second_rename_keeps_the_new_pack(tmp_path, voc8, voc40):
    out, pid = make_crash_state(tmp_path, voc8, voc40, "shards")
    os.replace(tmp_path / f".voc.tmp-{pid}-0ddba11a", out)  # the second rename happened
    committed = snapshot(out)
    fileio.clean_stale(out)
    assert listing(tmp_path) == ["voc"] and snapshot(out) == committed


def test_a_live_writers_folders_are_left_alone(tmp_path, voc8, voc40):
    out, pid = make_crash_state(tmp_path, voc8, voc40, "shards")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for name in listing(tmp_path):
            os.replace(tmp_path / name, tmp_path / name.replace(f"-{pid}-", f"-{sleeper.pid}-"))
        before = listing(tmp_path)
        fileio.clean_stale(out)  # that writer may still be between renames
        assert listing(tmp_path) == before and not out.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_failure_between_the_two_renames_puts_the_previous_pack_back(
    tmp_path, voc8, voc40, monkeypatch
):
    out = tmp_path / "voc"
    previous = snapshot(pack_voc(voc8, out, year="2007", **PACK_FORMS["shards"]).path)
    real_replace = os.replace

    def failing_replace(src: Any, dst: Any) -> None:
        if ".voc.tmp-" in Path(src).name:
            raise OSError(errno.EIO, "Input/output error (injected)")
        real_replace(src, dst)

    monkeypatch.setattr(fileio.os, "replace", failing_replace)
    with pytest.raises(WriteError, match="injected") as info:
        pack_voc(voc40, out, year="2007", **PACK_FORMS["shards"])
    monkeypatch.undo()
    assert str(out) in str(info.value) and isinstance(info.value, OSError)
    assert listing(tmp_path) == ["voc"] and snapshot(out) == previous


def test_an_old_output_that_cannot_be_removed_after_the_commit_is_logged(
    tmp_path, voc8, voc40, monkeypatch, caplog
):
    """Once the new pack has replaced the old one, failing to remove the old one (moved
    aside) is not a failed write: the pack is returned and the leftover logged (it raised
    "writing ... failed ... No partial output was left" with the new pack in place)."""
    import logging

    out = tmp_path / "voc"
    pack_voc(voc8, out, year="2007", **PACK_FORMS["shards"])
    real_remove = fileio.remove

    def failing_remove(path: Any) -> None:
        if ".voc.old-" in Path(path).name:
            raise OSError(errno.EIO, "Input/output error (injected)")
        real_remove(path)

    monkeypatch.setattr(fileio, "remove", failing_remove)
    with caplog.at_level(logging.WARNING, "torch_serialized.container.fileio"):
        result = pack_voc(voc40, out, year="2007", **PACK_FORMS["shards"])
    monkeypatch.undo()
    assert result.num_samples == len(open_pack(out)) > 8
    assert "could not be removed" in caplog.text and "injected" in caplog.text
    assert any(".voc.old-" in name for name in listing(tmp_path))  # a later process's pack
    # removes it (test_stale_temporaries_of_dead_processes_only_are_removed)


@pytest.mark.parametrize("form", ["single", "shards"])
def test_a_replacement_waits_for_a_running_append(tmp_path, voc8, voc40, form):
    """A pack replaced while an append holds it (its exclusive flock on the file or the
    folder) waits for the append to end: swapping the pack from under the append let its
    later writes, made by path, land in the new pack (a broken folder, both reporting
    success). Meanwhile the old pack is untouched; afterwards the new pack is complete."""
    import fcntl
    import threading

    out = tmp_path / out_name(form)
    pack_voc(voc8, out, year="2007", **PACK_FORMS[form])
    before = snapshot(out)
    fd = os.open(out, os.O_RDONLY)  # what an append holds for its whole run
    fcntl.flock(fd, fcntl.LOCK_EX)
    done: list[Any] = []
    thread = threading.Thread(
        target=lambda: done.append(pack_voc(voc40, out, year="2007", **PACK_FORMS[form]))
    )
    try:
        thread.start()
        thread.join(3)
        assert thread.is_alive() and not done and snapshot(out) == before
    finally:
        os.close(fd)
    thread.join(60)
    assert done and done[0].num_samples == 40
    assert open_pack(out).verify() == [] and len(open_pack(out)) == 40
