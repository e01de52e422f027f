"""Resume state: the ``Stateful`` protocol, the state's keys, and ``Resumable``, the resume
logic the iterable dataset and ``BlockShuffleSampler`` share.

torchdata's ``StatefulDataLoader`` saves and restores every dataset (and sampler) that has
``state_dict()`` and ``load_state_dict(state)``: its ``Stateful`` protocol, declared here
again so that torchdata stays an optional dependency. A state is a flat JSON-compatible dict
with the keys below: where the epoch stopped, and the settings and topology that fix the
order, checked when the state is resumed. Map-style datasets hold no state: with them the
sampler's position is the state.
"""

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


#: Version of the states; a state of another version is refused.
STATE_VERSION = 1

VERSION = "version"
#: The epoch being read, and the samples this worker yielded in it.
EPOCH = "epoch"
YIELDED = "yielded"
#: Which samples the state was saved on: the pack's id (new at every full pack, kept by
#: ``append_voc``) and a digest of the image set's record numbers. A resume on a re-packed or
#: changed image set is refused; a state saved before this key existed resumes unchecked.
PACK = "pack"
#: Where the state was saved (``Topology``'s fields): a resume must match them.
TOPOLOGY_KEYS = ("rank", "world_size", "worker", "num_workers")
#: The settings that fix the epoch's order: a resume must match them too.
ORDER_KEYS = ("num_samples", "shuffle", "seed", "drop_last", "block_size", "shuffle_buffer")

#: Which class saved a state (``BlockShuffleSampler``'s states carry it).
KIND = "kind"
#: The sampler's topology (it runs in the main process: no DataLoader worker) and order.
SAMPLER_TOPOLOGY_KEYS = ("rank", "world_size")
SAMPLER_ORDER_KEYS = ("num_samples", "shuffle", "seed", "drop_last", "block_size", "window")

T = TypeVar("T")


def samples_identity(dataset: Any) -> str | None:
    """``PACK`` of a torch_serialized dataset (map-style or iterable): its pack's id and a CRC
    of its image set's record numbers; None for any other dataset (nothing to check)."""
    reader = getattr(getattr(dataset, "pack", None), "reader", None)
    records = getattr(dataset, "records", None)
    if reader is None or not isinstance(records, np.ndarray):
        return None
    binding = getattr(reader, "binding", None)
    pack_id = binding.get("pack_id") if isinstance(binding, dict) else None
    digest = zlib.crc32(np.ascontiguousarray(records, dtype="<i8").tobytes())
    return f"{pack_id or 'unbound'}/{digest:08x}"


class Resumable(Stateful):
    """The epoch, what the current iteration handed out in it, and a loaded state that the
    next iteration resumes from once it has checked that the state describes the same
    samples in the same order."""

    #: the ``KIND`` a state carries (the sampler's), and what must stay the same to resume
    _KIND: str | None = None
    _HINT: str
    epoch: int
    _yielded = 0  # what the current iterator has handed out in this epoch
    _resume: dict[str, Any] | None = None  # a loaded state awaiting the next iteration
    _identity: str | None  # ``PACK`` of the samples, if known

    @abstractmethod
    def _settings(self) -> dict[str, Any]:
        """The topology and settings that fix the order (each class's own keys)."""

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration follows (a loaded position is
        kept for the same epoch, dropped for another)."""
        if epoch != self.epoch:
            self._resume = None
            self._yielded = 0
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        """Where this iteration is: epoch, samples handed out in it, and the settings that
        fix the order (JSON-compatible)."""
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
        """Resume from ``state_dict()``: the next iteration continues that epoch where it
        stopped. The settings must match the saved ones (checked then)."""
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
        """Start an iteration: how many of its items a loaded state says to skip (0 without
        one), after checking that the state was saved on these samples (``PACK``: unchecked
        when either side does not know) with these settings; ``where`` names the dataset."""
        state, skip = self._resume, 0
        if state is not None:
            before, now = state.get(PACK), self._identity
            if before is not None and now is not None and before != now:
                raise ValueError(
                    f"cannot resume {where}: the state was saved on other samples (pack "
                    f"{before!r}, now {now!r}): the pack was re-packed, or appended to with "
                    "this image set's records changed; resuming would mix the two in one "
                    "epoch, so start the epoch afresh (set_epoch) instead"
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
