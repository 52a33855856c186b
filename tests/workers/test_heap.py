"""The collector's pauses as a worker records them, and the frozen start-up heap."""

from __future__ import annotations

import gc
import subprocess
import sys

from mqinfer.workers.heap import CollectorPauses


def test_collector_pauses_count_each_generation_and_stop_when_removed():
    pauses = CollectorPauses().install()
    try:
        for _ in range(3):
            gc.collect(2)
        gc.collect(0)
    finally:
        pauses.remove()
    assert pauses.count[2] >= 3 and pauses.count[0] >= 1
    assert pauses.longest_s[2] > 0 and pauses.total_s[2] >= pauses.longest_s[2]
    before = list(pauses.count)
    gc.collect(2)
    assert pauses.count == before
    summary = pauses.summary()
    assert summary["collections"] == before and len(summary["pause_longest_ms"]) == 3


def test_a_frozen_heap_leaves_a_full_collection_only_what_came_after():
    code = (
        "import gc, json\n"
        "from mqinfer.workers.heap import freeze_startup_heap\n"
        "kept = [[i] for i in range(50_000)]\n"
        "before = len(gc.get_objects())\n"
        "freeze_startup_heap()\n"
        "print(json.dumps([before, len(gc.get_objects()), gc.get_freeze_count()]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    before, after, frozen = map(int, proc.stdout.strip().strip("[]").split(","))
    assert frozen >= 50_000 and after < before - 50_000
