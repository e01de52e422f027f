"""Resume state for torchdata's ``StatefulDataLoader`` (its protocol redeclared, so torchdata
stays optional). A state is a flat JSON-compatible dict: ``version``, ``epoch``, ``yielded``
(where the epoch stopped), the topology and settings that fix the order, and ``pack`` (pack id,
kept by appends, and record digest), all checked on resume."""

from __future__ import annotations

import zlib
from abc import abstractmethod
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from ..voc.packed import VOCPackReader


@runtime_checkable
class Stateful(Protocol):
    """An object whose progress can be saved and restored (torchdata's protocol)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> None: ...


STATE_VERSION = 1

T = TypeVar("T")


def samples_identity(dataset: Any) -> str | None:
    """``pack`` of a torch_serialized dataset (pack id, CRC of its record numbers), else None."""
    pack, records = getattr(dataset, "pack", None), getattr(dataset, "records", None)
    if not isinstance(pack, VOCPackReader) or not isinstance(records, np.ndarray):
        return None
    pack_id = (pack.reader.binding or {}).get("pack_id")
    digest = zlib.crc32(np.ascontiguousarray(records, dtype="<i8").tobytes())
    return f"{pack_id or 'unbound'}/{digest:08x}"


class Resumable(Stateful):
    """The epoch, what this iteration handed out, and a loaded state the next iteration
    resumes from once checked to describe the same samples in the same order."""

    _HINT: str  # what must stay the same to resume, for the error
    epoch: int
    _yielded = 0  # what the current iterator has handed out in this epoch
    _resume: dict[str, Any] | None = None  # a loaded state awaiting the next iteration
    _identity: str | None  # ``pack`` of the samples, if known

    @abstractmethod
    def _settings(self) -> dict[str, Any]:
        """The topology and settings that fix the order."""

    def set_epoch(self, epoch: int) -> None:
        """Select the next iteration's epoch (a loaded position is kept only for the same one)."""
        if epoch != self.epoch:
            self._resume = None
            self._yielded = 0
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        """Where this iteration is: epoch, samples handed out, order settings (JSON-compatible)."""
        if self._resume is not None:  # loaded, not yet iterated: still that point
            return dict(self._resume)
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "yielded": self._yielded,
            **self._settings(),
            **({} if self._identity is None else {"pack": self._identity}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next iteration goes on with that epoch, if it may."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"state version {state.get('version')!r} is not {STATE_VERSION}; load what "
                f"{type(self).__name__}.state_dict() returned"
            )
        yielded = int(state["yielded"])
        if yielded < 0:
            raise ValueError(f"state yielded {yielded} is negative; it is not a saved position")
        self.epoch = int(state["epoch"])
        self._yielded = yielded
        self._resume = dict(state)

    def _start(self, where: str) -> int:
        """The items a loaded state says to skip (0 without one), once checked to be saved on
        these samples with these settings."""
        state, skip = self._resume, 0
        if state is not None:
            before, now = state.get("pack"), self._identity
            if before is not None and now is not None and before != now:
                raise ValueError(
                    f"cannot resume {where}: the state was saved on other samples (pack "
                    f"{before!r}, now {now!r}: re-packed or appended to); start the epoch afresh"
                )
            settings = self._settings()
            diff = [(k, state.get(k), v) for k, v in settings.items() if state.get(k) != v]
            if diff:
                detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, a, b in diff)
                raise ValueError(
                    f"cannot resume {where}: the state was saved with other settings "
                    f"({detail}); resume with the same {self._HINT}"
                )
            skip, self._resume = int(state["yielded"]), None
        self._yielded = skip
        return skip

    def _counted(self, items: Iterable[T]) -> Iterator[T]:
        """``items``, each counted as handed out: a state taken now resumes after it."""
        for item in items:
            self._yielded += 1
            yield item
