"""The garbage collector in a long-lived serving process: its start-up heap frozen, its pauses
recorded."""

from __future__ import annotations

import gc
import time

from mqinfer.procs import freeze_heap, frozen_objects


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (the model's modules, the tokenizer, the imported
    modules: hundreds of thousands of them) out of the collector's reach.

    A full collection walks every tracked object. Without this, one stops a worker's loop for
    40-75 ms every few tens of seconds of serving (a small model on a CPU), and the requests that
    queue behind the pause make the TTFT tail; after it, a full collection walks only what was
    made since and takes about a millisecond. Frozen objects are never freed, which suits objects
    that live as long as the process; call it once, when start-up is done."""
    freeze_heap()


class CollectorPauses:
    """How long the collector held this process, per generation, from ``gc.callbacks``: counts,
    total and longest pause. Install it after start-up to see the pauses of serving alone."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.total_s = [0.0, 0.0, 0.0]
        self.longest_s = [0.0, 0.0, 0.0]
        self._began: float | None = None

    def install(self) -> "CollectorPauses":
        gc.callbacks.append(self._on_collection)
        return self

    def remove(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        if self._began is None:
            return
        pause, self._began = time.perf_counter() - self._began, None
        gen = info["generation"]
        self.count[gen] += 1
        self.total_s[gen] += pause
        self.longest_s[gen] = max(self.longest_s[gen], pause)

    def summary(self) -> dict:
        """The pauses, and how many objects start-up froze (0: the heap was not frozen)."""
        return {"frozen_objects": frozen_objects(), "collections": list(self.count),
                "pause_total_ms": [round(1000 * s, 3) for s in self.total_s],
                "pause_longest_ms": [round(1000 * s, 3) for s in self.longest_s]}
