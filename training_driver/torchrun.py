"""torchrun for the launchers, without torchrun's traceback after a rank's own message.

Why: when a rank exits non-zero, torchrun (torch.distributed.run) logs the failure and raises
``ChildFailedError``, ~30 lines of traceback and a table, and exits 1, after the rank has
already said what went wrong. A user mistake found inside a rank (exit 2, one line) would read
as a crash, and the exit status would lie. This module runs torchrun's own argument parser and
agent unchanged and only translates how it ends:

- a rank exits 2 (a ``UserError`` line is above): exit 2, nothing more;
- a rank was interrupted (130, SIGINT or SIGTERM) or torchrun itself got Ctrl-C / SIGTERM:
  exit 130;
- any other failure: one line naming the rank and its status (its traceback is above), that
  status.

    python -m training_driver.torchrun --nproc-per-node 2 -m training_driver.train ...
"""
from __future__ import annotations

import logging
import signal
import sys
from typing import Sequence

from lowp_common.cli import EXIT_INTERRUPTED, EXIT_USER_ERROR, cli_entry

PROG = "torchrun"
_INTERRUPTED = {EXIT_INTERRUPTED, -signal.SIGINT, -signal.SIGTERM,
                128 + signal.SIGINT, 128 + signal.SIGTERM}


def exit_status(rank_status: int) -> tuple[int, str | None]:
    """(this launcher's exit status, the line to print or None) for a failed rank's status."""
    if rank_status == EXIT_USER_ERROR:
        return EXIT_USER_ERROR, None
    if rank_status in _INTERRUPTED:
        return EXIT_INTERRUPTED, None
    if rank_status < 0:
        return 1, f"a training process was killed by signal {-rank_status}"
    return rank_status, f"a training process exited with status {rank_status} (see its message above)"


@cli_entry(PROG)
def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed import run as torch_run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torch_run.parse_args(list(sys.argv[1:] if argv is None else argv))
    # The agent's own "failed (exitcode: ...)" lines (the ranks' messages and ours say it) and
    # its OMP_NUM_THREADS notice; real agent errors still raise (and keep their traceback).
    for name in list(logging.root.manager.loggerDict):   # each has its own level (LOGLEVEL)
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        torch_run.run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        status, line = exit_status(int(failure.exitcode))
        if line:
            print(f"{PROG}: error: rank {rank}: {line}", file=sys.stderr, flush=True)
        if status == EXIT_INTERRUPTED:
            raise KeyboardInterrupt from None
        return status
    except SignalException:
        raise KeyboardInterrupt from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
