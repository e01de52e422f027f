"""Resume state: the ``Stateful`` protocol and the names of the state's keys, once.

torchdata's ``StatefulDataLoader`` saves and restores every dataset (and sampler) that has
``state_dict()`` and ``load_state_dict(state)``: its ``Stateful`` protocol, declared here
again so that torchdata stays an optional dependency. ``VOCSerializedIterableDataset`` is
``Stateful``; its state is a flat JSON-compatible dict with the keys below (``version``
``STATE_VERSION``): where the epoch stopped, and the settings and topology that fix the
order, checked when the state is loaded. Map-style datasets hold no state: with them the
sampler's position is the state.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Stateful",
    "STATE_VERSION",
    "VERSION",
    "EPOCH",
    "YIELDED",
    "TOPOLOGY_KEYS",
    "ORDER_KEYS",
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
#: Where the state was saved (``Topology``'s fields): a resume must match them.
TOPOLOGY_KEYS = ("rank", "world_size", "worker", "num_workers")
#: The settings that fix the epoch's order: a resume must match them too.
ORDER_KEYS = ("num_samples", "shuffle", "seed", "drop_last", "block_size", "shuffle_buffer")
