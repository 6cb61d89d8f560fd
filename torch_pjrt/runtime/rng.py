"""Random number state per device: a seed and a counter, turned into a jax key per op.

Each random op takes the next counter value; (seed, counter) is the raw key of jax's
threefry generator, a keyed pseudo-random function, so streams never repeat and a
seed gives the same numbers on every run. The state is two integers, cheap to save.
"""

from __future__ import annotations

import random
import threading

import numpy as np

_MASK = 0xFFFFFFFF
_DEFAULT_SEED = 67280421310721  # the value torch.initial_seed() reports before any seeding


class DeviceRng:
    __slots__ = ("seed", "counter", "lock")

    def __init__(self, seed: int = _DEFAULT_SEED) -> None:
        self.seed = seed
        self.counter = 0
        self.lock = threading.Lock()

    def manual_seed(self, seed: int) -> None:
        self.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        self.counter = 0

    def next_key(self) -> np.ndarray:
        with self.lock:
            counter = self.counter
            self.counter += 1
        return raw_key(self.seed, counter)

    def get_state(self) -> np.ndarray:
        return np.array([self.seed, self.counter], dtype=np.uint64).view(np.uint8)

    def set_state(self, state: np.ndarray) -> None:
        values = np.ascontiguousarray(state, dtype=np.uint8).view(np.uint64)
        if values.shape != (2,):
            raise RuntimeError("a pjrt RNG state is 16 bytes, as returned by torch.pjrt.get_rng_state().")
        self.seed, self.counter = int(values[0]), int(values[1])


def raw_key(seed: int, counter: int) -> np.ndarray:
    """Threefry key data for (seed, counter): both 64-bit values folded into two words."""
    high = (seed ^ (seed >> 32) ^ ((counter >> 32) * 0x9E3779B9)) & _MASK
    return np.array([high, counter & _MASK], dtype=np.uint32)


_states: dict[int, DeviceRng] = {}
_default_seed = [_DEFAULT_SEED]


def state(index: int) -> DeviceRng:
    rng = _states.get(index)
    if rng is None:
        rng = _states.setdefault(index, DeviceRng(_default_seed[0]))
    return rng


def manual_seed_all(seed: int) -> None:
    """Seed every device, including those not used yet (no device query: torch.manual_seed stays cheap)."""
    _default_seed[0] = int(seed) & 0xFFFFFFFFFFFFFFFF
    for rng in _states.values():
        rng.manual_seed(seed)


def fresh_seed() -> int:
    return random.SystemRandom().getrandbits(63)
