"""A section drawer that never returns: a stuck worker, for the report pool's tests.

Importable by the worker processes (they import this module by name to unpickle
``draw_or_hang``); ``python tests/stuck_section.py ARGS`` runs the report command with it.
"""
import sys
import time

from tensor_viz import pipeline

STUCK = "fp8_analysis"
REAL = pipeline._draw_section


def draw_or_hang(name: str) -> list:
    if name == STUCK:
        while True:              # like a deadlocked worker: only a signal ends it
            time.sleep(60)
    return REAL(name)


if __name__ == "__main__":
    import stuck_section  # by its module name: workers import it to find the function

    from tensor_viz.full import main

    pipeline._draw_section = stuck_section.draw_or_hang
    sys.exit(main(sys.argv[1:]))
