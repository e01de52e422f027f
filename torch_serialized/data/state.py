"""Resume state for torchdata's ``StatefulDataLoader`` (its protocol redeclared, so torchdata
stays optional). A state is a flat JSON-compatible dict: where the epoch stopped, and the
settings and topology that fix the order, checked on resume."""

from __future__ import annotations

import zlib
from abc import abstractmethod
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np


@runtime_checkable
class Stateful(Protocol):
    """An object whose progress can be saved and restored (torchdata's protocol)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> None: ...


STATE_VERSION = 1
VERSION = "version"
EPOCH = "epoch"
YIELDED = "yielded"
PACK = "pack"  #: samples saved on: pack id (kept by appends), record digest
TOPOLOGY_KEYS = ("rank", "world_size", "worker", "num_workers")
ORDER_KEYS = ("num_samples", "shuffle", "seed", "drop_last", "block_size", "shuffle_buffer")
KIND = "kind"  #: which class saved a state (``BlockShuffleSampler``'s carry it)
SAMPLER_TOPOLOGY_KEYS = ("rank", "world_size")
SAMPLER_ORDER_KEYS = ("num_samples", "shuffle", "seed", "drop_last", "block_size", "window")

T = TypeVar("T")


def samples_identity(dataset: Any) -> str | None:
    """``PACK`` of a torch_serialized dataset (pack id, CRC of its record numbers), else None."""
    reader = getattr(getattr(dataset, "pack", None), "reader", None)
    records = getattr(dataset, "records", None)
    if reader is None or not isinstance(records, np.ndarray):
        return None
    binding = getattr(reader, "binding", None)
    pack_id = binding.get("pack_id") if isinstance(binding, dict) else None
    digest = zlib.crc32(np.ascontiguousarray(records, dtype="<i8").tobytes())
    return f"{pack_id or 'unbound'}/{digest:08x}"


class Resumable(Stateful):
    """The epoch, what this iteration handed out, and a loaded state the next iteration
    resumes from once checked to describe the same samples in the same order."""

    _KIND: str | None = None  # the ``KIND`` a state carries
    _HINT: str  # what must stay the same to resume, for the error
    epoch: int
    _yielded = 0  # what the current iterator has handed out in this epoch
    _resume: dict[str, Any] | None = None  # a loaded state awaiting the next iteration
    _identity: str | None  # ``PACK`` of the samples, if known

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
            VERSION: STATE_VERSION,
            **({} if self._KIND is None else {KIND: self._KIND}),
            EPOCH: self.epoch,
            YIELDED: self._yielded,
            **self._settings(),
            **({} if self._identity is None else {PACK: self._identity}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next iteration goes on with that epoch, if it may."""
        owner = type(self).__name__
        if state.get(VERSION) != STATE_VERSION:
            raise ValueError(
                f"state version {state.get(VERSION)!r} is not {STATE_VERSION}; it was not "
                f"saved by this {owner}"
            )
        if self._KIND is not None and state.get(KIND) != self._KIND:
            raise ValueError(
                f"state kind {state.get(KIND)!r} is not {self._KIND!r}: another class saved "
                f"it; load what {owner}.state_dict() returned"
            )
        yielded = int(state[YIELDED])
        if yielded < 0:
            raise ValueError(f"state yielded {yielded} is negative; it is not a saved position")
        self.epoch = int(state[EPOCH])
        self._yielded = yielded
        self._resume = dict(state)

    def _start(self, where: str) -> int:
        """The items a loaded state says to skip (0 without one), once checked to be saved on
        these samples with these settings."""
        state, skip = self._resume, 0
        if state is not None:
            before, now = state.get(PACK), self._identity
            if before is not None and now is not None and before != now:
                raise ValueError(
                    f"cannot resume {where}: the state was saved on other samples (pack "
                    f"{before!r}, now {now!r}): the pack was re-packed, or appended to with "
                    "this image set's records changed; start the epoch afresh (set_epoch)"
                )
            settings = self._settings()
            diff = [(k, state.get(k), v) for k, v in settings.items() if state.get(k) != v]
            if diff:
                detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, a, b in diff)
                raise ValueError(
                    f"cannot resume {where}: the state was saved with other settings "
                    f"({detail}); resume with the same {self._HINT}"
                )
            skip, self._resume = int(state[YIELDED]), None
        self._yielded = skip
        return skip

    def _counted(self, items: Iterable[T]) -> Iterator[T]:
        """``items``, each counted as handed out: a state taken now resumes after it."""
        for item in items:
            self._yielded += 1
            yield item
