"""``python -m training_profiler.static_checker``: the documented path of ``amp-static-check``.
The checker lives in ``training_profiler.amp_checker`` (its command: ``amp_checker.checker``)."""
import sys

from training_profiler.amp_checker.checker import main

if __name__ == "__main__":
    sys.exit(main())
