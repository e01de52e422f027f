"""Resume state for torchdata's ``StatefulDataLoader`` (its protocol redeclared, so torchdata
stays optional). A state is a flat JSON-compatible dict: ``version``, ``epoch``, ``yielded``
(where the epoch stopped), the topology and settings that fix the order, and ``pack`` (pack id,
kept by appends, and record digest), all checked on resume. ``merge_states`` makes one state of
every rank's and worker's, which a stream resumes on another topology (``progress``)."""

from __future__ import annotations

import zlib
from abc import abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from ..voc.packed import VOCPackReader


@runtime_checkable
class Stateful(Protocol):
    """An object whose progress can be saved and restored (torchdata's protocol)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> None: ...


__all__ = ["Stateful", "merge_states"]

STATE_VERSION = 1
#: the keys of a state that say which rank and worker saved it
TOPOLOGY = ("rank", "world_size", "worker", "num_workers")

T = TypeVar("T")


def samples_identity(dataset: Any) -> str | None:
    """``pack`` of a torch_serialized dataset (pack id, CRC of its record numbers; of each
    source, joined by ``+``), else None."""
    parts = getattr(dataset, "_parts", None)
    if isinstance(parts, list) and len(parts) > 1:
        identities = [samples_identity(part) for part in parts]
        return None if None in identities else "+".join(map(str, identities))
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
    #: a merged state's ``progress``: what an epoch on another topology handed out before
    _after: dict[str, Any] | None = None
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
        state, self._after = self._resume, None
        if state is None:
            self._yielded = 0
            return 0
        before, now = state.get("pack"), self._identity
        if before is not None and now is not None and before != now:
            raise ValueError(
                f"cannot resume {where}: the state was saved on other samples (pack "
                f"{before!r}, now {now!r}: re-packed or appended to); start the epoch afresh"
            )
        merged = state.get("progress")  # from merge_states: on any topology, after what was handed
        if merged is not None and "after" not in self._settings():
            raise ValueError(
                f"cannot resume {where} from merged states: only a "
                "VOCSerializedIterableDataset resumes on another topology"
            )
        self._after = merged if merged is not None else state.get("after")
        ignored = () if merged is None else (*TOPOLOGY, "after")
        diff = [
            (k, state.get(k), v)
            for k, v in self._settings().items()
            if k not in ignored and state.get(k) != v
        ]
        if diff:
            detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, a, b in diff)
            raise ValueError(
                f"cannot resume {where}: the state was saved with other settings "
                f"({detail}); resume with the same {self._HINT}"
            )
        self._resume = None
        self._yielded = 0 if merged is not None else int(state["yielded"])
        return self._yielded

    def _counted(self, items: Iterable[T]) -> Iterator[T]:
        """``items``, each counted as handed out: a state taken now resumes after it."""
        for item in items:
            self._yielded += 1
            yield item


def merge_states(states: Iterable[Any]) -> dict[str, Any]:
    """One state of an epoch from every rank's and worker's: the ``state_dict()`` of each
    rank's ``StatefulDataLoader`` (or of the datasets), gathered from all ranks, e.g. with
    ``torch.distributed.all_gather_object``. ``VOCSerializedIterableDataset.load_state_dict``
    resumes it on any number of ranks and workers: exactly what was not handed out yet."""
    found: dict[tuple[int, int], dict[str, Any]] = {}
    for state in _dataset_states(states):
        place = (state["rank"], state["worker"])
        if found.setdefault(place, state) != state:
            raise ValueError(
                f"two different states of rank {place[0]}, worker {place[1]}: pass the states "
                "of one checkpoint, one per rank"
            )
    if not found:
        raise ValueError(
            "no VOCSerializedIterableDataset state in what was given: pass every rank's "
            "loader.state_dict() (or dataset.state_dict()) of one checkpoint"
        )
    first = next(iter(found.values()))
    own = ("rank", "worker", "yielded")  # what differs between the states of one checkpoint
    shared = {k: v for k, v in first.items() if k not in own}
    for (rank, worker), state in found.items():
        other = {k: v for k, v in state.items() if k not in own}
        if other != shared:
            diff = sorted(k for k in shared.keys() | other.keys() if shared.get(k) != other.get(k))
            raise ValueError(
                f"the state of rank {rank}, worker {worker} differs in {diff} from the others: "
                "pass the states of one checkpoint of one epoch"
            )
    world, workers = first["world_size"], first["num_workers"]
    missing = [(r, w) for r in range(world) for w in range(workers) if (r, w) not in found]
    if missing:
        raise ValueError(
            f"{len(missing)} of the {world * workers} states of the saved topology ({world} "
            f"ranks x {workers} workers) are missing, e.g. rank {missing[0][0]}, worker "
            f"{missing[0][1]}: gather every rank's state_dict() (all_gather_object)"
        )
    progress = {
        "world_size": world,
        "num_workers": workers,
        "yielded": [[found[r, w]["yielded"] for w in range(workers)] for r in range(world)],
        "after": shared.get("after"),
    }
    kept = {k: v for k, v in shared.items() if k not in ("world_size", "num_workers", "after")}
    return {**kept, "yielded": 0, "progress": progress}


def _dataset_states(value: Any) -> Iterator[dict[str, Any]]:
    """The stream states in ``value``: states, loader states, lists of them, nested."""
    if isinstance(value, Mapping):
        if {"version", "epoch", "yielded", *TOPOLOGY} <= value.keys():
            yield dict(value)
            return
        if value.get("_steps_since_snapshot", 0):
            raise ValueError(
                "a StatefulDataLoader state taken between snapshots cannot be merged: save "
                "with snapshot_every_n_steps=1 (the default)"
            )
        for item in value.values():
            yield from _dataset_states(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _dataset_states(item)
