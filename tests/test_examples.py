"""Each script in examples/ runs on a generated sample and prints what it promises, and runs
to the end (or stops with a clear message) on a custom-class VOC2007 set smaller than one
batch, found without ``--year``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from vocfactory import Sample, jpeg, obj, palette_mask, voc_xml, write_voc

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# (script, arguments that keep the run small, lines the output must contain)
CASES = [
    (
        "batched_decode.py",
        ["--num-images", "24", "--batch-size", "8"],
        ["24 samples on", "last batch (8, 3, 224, 224)", "equals decode='tensor': True"],
    ),
    (
        "pack_and_iterate.py",
        ["--num-images", "24"],
        ["packed 24 samples", "identical to torchvision: True", "iterable: epoch 1: 12 samples"],
    ),
    (
        "train_detection.py",
        ["--num-images", "16", "--steps", "2", "--batch-size", "2"],
        ["step 2: loss", "trained 2 steps"],
    ),
    (
        "ddp_iterable.py",
        ["--num-images", "24", "--epochs", "1", "--nproc", "2"],
        ["rank 1/2 epoch 0: 6 samples"],
    ),
    (
        "stream_from_s3.py",
        ["--num-images", "60"],
        ["packed 60 samples of VOC2007 to s3://", "streamed 31 samples", "as the local pack: True"],
    ),
    (
        "segmentation.py",
        ["--num-images", "32", "--steps", "2", "--batch-size", "2", "--crop", "128"],
        ["a VOCSegmentation: True", "step 2: loss", "trained 2 steps"],
    ),
    (
        "train_07_12.py",
        ["--num-images", "16", "--steps", "2", "--batch-size", "2"],
        [
            "packed 16 samples of VOC2012",
            "streaming 2 pack(s), VOC2007+2012 trainval: 24 samples",
            "trained 2 steps",
            "evaluated on 8 VOC2007 test images",
        ],
    ),
]

# The same scripts on TWO train images of custom classes ("helmet", "head"), float boxes and
# masks, year 2007 found from the folder: default batch sizes (4 to 32) exceed the set.
SMALL_CASES = [
    (
        "batched_decode.py",
        [],
        ["packed 3 samples of VOC2007", "3 samples on", "last batch (3, 3, 224, 224)"],
    ),
    (
        "pack_and_iterate.py",
        [],
        [
            "packed 3 samples of VOC2007",
            "identical to torchvision: True",
            "tv_tensors labels: ['__background__', 'helmet', 'head']",
            "iterable: epoch 1: 2 samples",
        ],
    ),
    (
        "train_detection.py",
        ["--steps", "3"],
        ["only 2 train samples: batch size 2", "2 classes (helmet, head)", "trained 3 steps"],
    ),
    ("ddp_iterable.py", ["--epochs", "1"], ["rank 1/2 epoch 0: 1 samples"]),
    (
        "stream_from_s3.py",
        [],
        ["packed 3 samples of VOC2007 to s3://", "streamed 3 samples", "as the local pack: True"],
    ),
    (
        "segmentation.py",
        ["--steps", "3", "--crop", "64"],
        ["only 2 train masks: batch size 2", "step 3: loss", "trained 3 steps"],
    ),
    (
        "train_07_12.py",
        ["--steps", "2"],
        [
            "streaming 1 pack(s), VOC2007 trainval: 3 samples",
            "2 classes after '__background__'",
            "trained 2 steps",
            "VOC2007 has no test image set here",
        ],
    ),
]


def test_every_example_is_tested() -> None:
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts == sorted(c[0] for c in CASES) == sorted(c[0] for c in SMALL_CASES)


def test_every_example_takes_a_year() -> None:
    """README: every example finds the year, and ``--year`` picks one where a root holds
    several (stream_from_s3.py took none: a two-year root could not be streamed)."""
    for script in EXAMPLES.glob("*.py"):
        source = script.read_text(encoding="utf-8")
        assert 'add_argument("--year"' in source, script.name
        assert "--year" in source.split('"""')[1], f"{script.name}: its docstring omits --year"


def run_example(script: str, args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "error::DeprecationWarning", "TMPDIR": str(tmp_path)}
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=env,
    )


#: Example runs at a time: each is one process, mostly waiting on torch's import or on
#: DataLoader workers, so two overlap well on a 2-core CI machine (the runs took ~100 s of
#: CI's 15 minutes one after the other).
PARALLEL_RUNS = 2

Run = tuple[subprocess.CompletedProcess, Path]


@pytest.fixture(scope="module")
def example_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str, list[str]], Run]:
    """Every example run the session selected, started together ``PARALLEL_RUNS`` at a time
    on first use; ``get(kind, script, args)`` waits for one and returns it with its folder."""
    selected = {
        (item.originalname, item.callspec.id)
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    }
    pool = ThreadPoolExecutor(PARALLEL_RUNS, thread_name_prefix="example")
    request.addfinalizer(pool.shutdown)
    futures: dict[tuple[str, str], Future[Run]] = {}

    def start(kind: str, script: str, args: list[str]) -> None:
        folder = tmp_path_factory.mktemp(f"{kind}-{script}")
        futures[kind, script] = pool.submit(lambda: (run_example(script, args, folder), folder))

    for script, args, _ in CASES:
        if ("test_example_runs", script) in selected:
            start("sample", script, args)
    for script, args, _ in SMALL_CASES:
        if ("test_example_finishes_on_a_set_smaller_than_a_batch", script) in selected:
            root = request.getfixturevalue("small_custom_root")
            start("small", script, [str(root), *args])

    def get(kind: str, script: str, args: list[str]) -> Run:
        if (kind, script) not in futures:
            start(kind, script, args)
        return futures[kind, script].result()

    return get


@pytest.mark.slow
@pytest.mark.parametrize(("script", "args", "expected"), CASES, ids=[c[0] for c in CASES])
def test_example_runs(
    script: str, args: list[str], expected: list[str], example_runs: Callable[..., Run]
) -> None:
    done, folder = example_runs("sample", script, args)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for line in expected:
        assert line in done.stdout, done.stdout
    assert not [p for p in folder.iterdir() if p.name.startswith("tser-")], "temp data left"


@pytest.fixture(scope="module")
def small_custom_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """torchvision's root of 3 samples (train: 2, val: 1) of custom classes, VOC2007."""
    root = tmp_path_factory.mktemp("small-custom")
    boxes = [
        [obj("helmet", (3.5, 4, 40.25, 30)), obj("head", (10, 12, 50, 44))],
        [obj("head", (5, 6, 60, 40))],
        [obj("helmet", (1, 1, 20, 20))],
    ]
    samples = [
        Sample(
            f"img{i}",
            jpeg(72, 56, seed=i),
            voc_xml(f"img{i}.jpg", 72, 56, objects),
            mask=palette_mask(72, 56, seed=i, values=[1, 2]),
        )
        for i, objects in enumerate(boxes)
    ]
    lists = {"train": ["img0", "img1"], "val": ["img2"], "trainval": ["img0", "img1", "img2"]}
    write_voc(root, "2007", samples, {"Main": lists, "Segmentation": lists})
    return root


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "args", "expected"), SMALL_CASES, ids=[c[0] for c in SMALL_CASES]
)
def test_example_finishes_on_a_set_smaller_than_a_batch(
    script: str,
    args: list[str],
    expected: list[str],
    small_custom_root: Path,
    example_runs: Callable[..., Run],
) -> None:
    done, folder = example_runs("small", script, [str(small_custom_root), *args])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for line in expected:
        assert line in done.stdout, done.stdout
    assert not [p for p in folder.iterdir() if p.name.startswith("tser-")], "temp data left"


@pytest.mark.slow
def test_segmentation_example_says_what_a_detection_only_set_lacks(tmp_path: Path) -> None:
    root = tmp_path / "detection-only"
    sample = Sample("a", jpeg(32, 24), voc_xml("a.jpg", 32, 24, [obj("head", (1, 1, 9, 9))]))
    write_voc(root, "2007", [sample], {"Main": {"train": ["a"]}})
    done = run_example("segmentation.py", [str(root), "--workers", "0"], tmp_path)
    assert done.returncode == 1
    assert f"error: {root} has no Segmentation train list" in done.stderr
    assert "Traceback" not in done.stderr
