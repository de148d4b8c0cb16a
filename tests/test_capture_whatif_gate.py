"""The what-if budget charges each job the time it held the writer thread, by the gate's own
clock (wall time), not the thread's CPU time: a job that waits (for the GIL the training thread
holds, for a core another process holds) keeps the statistics queued behind it waiting as long."""
from __future__ import annotations

import torch

from tensor_capture import schema, whatif
from tensor_capture.whatif import WhatifGate, WhatifJob


def test_a_job_is_charged_its_time_by_the_gate_clock():
    ticks = iter([10.0, 13.5])                 # the clock read as the job starts and ends
    gate = WhatifGate(0.25, clock=lambda: next(ticks))
    x = torch.randn(8, 64)
    plan = whatif.plan(("mxfp8",), x, schema.VARIANT_HP, -1)
    out = WhatifJob(plan, x, x.numel(), gate).run()
    assert gate.spent == 3.5
    assert out[schema.WHATIF_FORMATS]["mxfp8"]["sqnr_db"] > 0

