"""Where the tests find the real VOC-format data: a setting, a default, and honest skips."""

from __future__ import annotations

from pathlib import Path

import pytest
from vocfactory import (
    REAL_VOC_DEFAULT,
    REAL_VOC_ENV,
    real_voc_dir,
    real_voc_roots,
    real_voc_skip_reason,
)


def test_the_setting_points_at_the_real_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, year in (("b-set", "2012"), ("a-set", "2007")):
        (tmp_path / name / "VOCdevkit" / f"VOC{year}").mkdir(parents=True)
    (tmp_path / "notes").mkdir()  # not a root: ignored
    monkeypatch.setenv(REAL_VOC_ENV, str(tmp_path))
    assert real_voc_dir() == tmp_path
    assert real_voc_roots() == [(tmp_path / "a-set", "2007"), (tmp_path / "b-set", "2012")]
    assert str(tmp_path) in real_voc_skip_reason()


def test_without_the_setting_the_folder_beside_the_repository(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(REAL_VOC_ENV, raising=False)
    assert real_voc_dir() == REAL_VOC_DEFAULT
    assert REAL_VOC_DEFAULT.parts[-3:] == ("shared", "data", "voc-real")
    assert REAL_VOC_DEFAULT.parent.parent.parent == Path(__file__).resolve().parents[2]
    reason = real_voc_skip_reason()
    assert REAL_VOC_ENV in reason and str(REAL_VOC_DEFAULT) in reason


def test_a_setting_without_roots_fails_instead_of_skipping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(REAL_VOC_ENV, str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match=REAL_VOC_ENV):
        real_voc_roots()
