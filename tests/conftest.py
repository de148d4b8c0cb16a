"""Shared test setup: headless plotting, one thread per process (2-core CI)."""
import os

os.environ.setdefault("MPLBACKEND", "Agg")

import torch  # noqa: E402

torch.set_num_threads(1)
