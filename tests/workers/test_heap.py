"""The collector's pauses as a worker records them, and the frozen start-up heap."""

from __future__ import annotations

import json
import subprocess
import sys


def test_collector_pauses_count_each_generation_and_stop_when_removed():
    # In a small fresh process: a full collection here would walk this test process's whole heap.
    code = (
        "import gc, json\n"
        "from mqinfer.workers.heap import CollectorPauses\n"
        "kept = [[i] for i in range(20_000)]\n"
        "pauses = CollectorPauses().install()\n"
        "try:\n"
        "    for _ in range(3):\n"
        "        gc.collect(2)\n"
        "    gc.collect(0)\n"
        "finally:\n"
        "    pauses.remove()\n"
        "before = list(pauses.count)\n"
        "gc.collect(2)\n"
        "print(json.dumps([pauses.count, pauses.longest_s, pauses.total_s, before, pauses.summary()]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    count, longest_s, total_s, before, summary = json.loads(proc.stdout)
    assert count[2] >= 3 and count[0] >= 1
    assert longest_s[2] > 0 and total_s[2] >= longest_s[2]
    assert count == before  # removed: the last collection was not counted
    assert summary["collections"] == before and len(summary["pause_longest_ms"]) == 3


def test_a_frozen_heap_leaves_a_full_collection_only_what_came_after():
    code = (
        "import gc, json\n"
        "from mqinfer.workers.heap import freeze_startup_heap\n"
        "from mqinfer.procs import frozen_objects\n"
        "kept = [[i] for i in range(50_000)]\n"
        "before = len(gc.get_objects())\n"
        "freeze_startup_heap()\n"
        "print(json.dumps([before, len(gc.get_objects()), gc.get_freeze_count(), frozen_objects()]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    before, after, frozen, counted = map(int, proc.stdout.strip().strip("[]").split(","))
    assert frozen >= 50_000 and after < before - 50_000
    # Counted as they were frozen, without walking the frozen list: to within the few objects made
    # or freed between the count and the freeze.
    assert abs(counted - frozen) <= 16


def test_a_forked_child_counts_its_parents_frozen_objects_and_its_own():
    """As a worker forked from the warm template does: the parent freezes its imports, the child
    freezes what its start-up made; the count covers both, as the collector's own count does."""
    code = (
        "import gc, json, os\n"
        "from mqinfer.procs import freeze_heap, frozen_objects\n"
        "parent = [[i] for i in range(20_000)]\n"
        "freeze_heap()\n"
        "r, w = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    own = [[i] for i in range(30_000)]\n"
        "    freeze_heap()\n"
        "    os.write(w, json.dumps([frozen_objects(), gc.get_freeze_count()]).encode())\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print(json.dumps([frozen_objects(), gc.get_freeze_count(), *json.loads(os.read(r, 1000))]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    parent_counted, parent_frozen, child_counted, child_frozen = json.loads(proc.stdout)
    assert parent_frozen >= 20_000 and abs(parent_counted - parent_frozen) <= 16
    assert child_frozen >= parent_frozen + 30_000 and abs(child_counted - child_frozen) <= 16
