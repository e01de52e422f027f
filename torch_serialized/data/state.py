"""Resume state: the ``Stateful`` protocol, the names of the state's keys and their checks.

torchdata's ``StatefulDataLoader`` saves and restores every dataset (and sampler) that has
``state_dict()`` and ``load_state_dict(state)``: its ``Stateful`` protocol, declared here
again so that torchdata stays an optional dependency. ``VOCSerializedIterableDataset`` and
``BlockShuffleSampler`` are ``Stateful``; a state is a flat JSON-compatible dict with the keys
below (``version`` ``STATE_VERSION``): where the epoch stopped, and the settings and topology
that fix the order, checked when the state is resumed (``check_version``, ``check_same``).
Map-style datasets hold no state: with them the sampler's position is the state.
"""

from __future__ import annotations

import zlib
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "Stateful",
    "STATE_VERSION",
    "VERSION",
    "EPOCH",
    "YIELDED",
    "KIND",
    "PACK",
    "TOPOLOGY_KEYS",
    "ORDER_KEYS",
    "SAMPLER_TOPOLOGY_KEYS",
    "SAMPLER_ORDER_KEYS",
    "check_version",
    "check_same",
    "samples_identity",
    "check_samples",
]


@runtime_checkable
class Stateful(Protocol):
    """An object whose progress can be saved and restored (torchdata's protocol)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> None: ...


#: Version of the iterable dataset's state; a state of another version is refused.
STATE_VERSION = 1

VERSION = "version"
#: The epoch being read, and the samples this worker yielded in it.
EPOCH = "epoch"
YIELDED = "yielded"
#: Which samples the state was saved on: the pack's id (new at every full pack, kept by
#: ``append_voc``) and a digest of the image set's record numbers. A resume on a re-packed or
#: changed image set is refused; a state saved before this key existed resumes unchecked
#: on it.
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


def check_version(state: dict[str, Any], owner: str, kind: str | None = None) -> None:
    """Refuse a state of another version, or (with ``kind``) one another class saved."""
    if state.get(VERSION) != STATE_VERSION:
        raise ValueError(
            f"state version {state.get(VERSION)!r} is not {STATE_VERSION}; it was not saved by "
            f"this {owner}"
        )
    if kind is not None and state.get(KIND) != kind:
        raise ValueError(
            f"state kind {state.get(KIND)!r} is not {kind!r}: another class saved it; load "
            f"what {owner}.state_dict() returned"
        )


def check_same(saved: dict[str, Any], now: dict[str, Any], where: str, hint: str) -> None:
    """Refuse to resume when a setting or the topology differs from the saved one; ``hint``
    says what must stay the same."""
    diff = {k: (saved.get(k), now[k]) for k in now if saved.get(k) != now[k]}
    if diff:
        detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
        raise ValueError(
            f"cannot resume {where}: the state was saved with other settings ({detail}); "
            f"resume with the same {hint}"
        )


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


def check_samples(saved: dict[str, Any], now: str | None, where: str) -> None:
    """Refuse to resume on other samples than the state was saved on (``PACK``): a re-pack of
    the same size would otherwise mix two packs in one epoch. Unchecked when either side does
    not know (a state saved before the key existed, a sampler given a length)."""
    before = saved.get(PACK)
    if before is None or now is None or before == now:
        return
    raise ValueError(
        f"cannot resume {where}: the state was saved on other samples (pack {before!r}, now "
        f"{now!r}): the pack was re-packed, or appended to with this image set's records "
        "changed; resuming would mix the two in one epoch, so start the epoch afresh "
        "(set_epoch) instead"
    )
