"""memory.settle_heap: the garbage collector of a serving process (each case in a fresh
interpreter, as the setting is the whole process's)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_step_of_short_lived_objects_runs_no_collection_and_cycles_are_still_freed() -> None:
    out = run_python(
        """
        import gc, weakref
        from tokenmill.memory import YOUNG_COLLECTION_THRESHOLD, settle_heap

        loaded = [[i] for i in range(50_000)]  # what a load leaves, living on
        settle_heap()
        collections = []
        gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info))

        # One engine step at 1,024 requests: ~12 objects each, alive together, then freed.
        step = [[i] for i in range(12 * 1024)]
        del step
        print(len(collections), gc.get_freeze_count() >= len(loaded))

        class Node:
            __slots__ = ("link", "__weakref__")  # a node links to itself: a cycle

        # Garbage in cycles, past the threshold: still collected.
        first = Node()
        first.link = first
        alive = weakref.ref(first)
        del first
        for _ in range(YOUNG_COLLECTION_THRESHOLD):
            node = Node()
            node.link = node
        del node
        print(len(collections) > 0, alive() is None)
        """
    )
    assert out.splitlines() == ["0 True", "True True"]
