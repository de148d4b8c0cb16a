"""A byte budget too small for one iteration on ONE rank stops EVERY rank at the step boundary.

Two real processes over gloo drive tensor_capture's schedule wrapper (no Megatron: a schedule
function with megatron-core's keyword interface); rank 0's budget cannot hold its first
iteration, rank 1's can. Each step ends with a collective, as a training step does, so a rank
left running while the other exited would fail there (or hang) instead of exiting 2.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tensor_capture import schema

pytestmark = pytest.mark.multiprocess      # two processes over gloo, ~10 s

_WORKER = textwrap.dedent("""
    import datetime, os, sys
    import torch
    import torch.distributed as dist
    from tensor_capture import numbering, saver as ts
    from tensor_capture.schema import CaptureSite

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    ts.configure(enabled=True, save_dir=os.path.join(sys.argv[1], f"r{rank}"),
                 byte_budget=300 if rank == 0 else 10**9, max_iterations=3)

    def forward_step(data_iterator, model):
        saver = ts.get_tensor_saver()
        for i in range(3):      # 256 B each: the second one overflows rank 0's 300 B
            saver.capture(torch.randn(64), CaptureSite(layer_type="linear", operation="forward",
                                                       phase="pre", tensor_name=f"t{i}"))

    def schedule(*, forward_step_func, data_iterator, model, num_microbatches,
                 forward_only=False):
        for _ in range(num_microbatches):
            forward_step_func(data_iterator, model)

    step = numbering.wrap_schedule(schedule)
    for _ in range(3):
        step(forward_step_func=forward_step, data_iterator=None, model=[None],
             num_microbatches=1)
        dist.all_reduce(torch.zeros(1))        # the next step's collective
    print("trained past the budget stop")
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_budget_stop_on_one_rank_stops_every_rank_with_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TENSOR_SAVE", "CUSTOM_QUANT"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 2, err[-3000:]
        assert "trained past" not in out and "Traceback" not in err, err[-3000:]
    line = outs[0][1].strip().splitlines()[-1]
    assert line.startswith("tensor capture: byte_budget 300 B per rank cannot hold one iteration")
    assert "(iteration 0 needs 768 B on rank 0)" in line
    assert "cannot hold" not in outs[1][1]        # rank 1's own budget held: no line of its own
    # both stopped after iteration 0, their records written whole
    for r, files in ((0, 1), (1, 3)):
        recs = list(schema.read_manifest(Path(tmp_path) / f"r{r}"))
        assert {rec["iteration"] for rec in recs} == {0} and len(recs) == 3
        assert sum(rec["file"] is not None for rec in recs) == files
