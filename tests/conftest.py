"""Shared test setup: headless plotting, one thread per process (2-core CI), and the test tiers.

Tiers: ``python -m pytest -q tests`` runs everything (CI); ``python -m pytest -m "not slow"``
is the fast tier (under a minute on 2 cores). A test is slow when it carries one of the slow
tiers' markers, either from ``SLOW_TIERS`` below (keyed by module or module::test, so test files
need no edits) or from its own ``pytestmark`` / ``@pytest.mark.megatron`` etc.
"""
import fnmatch
import os

os.environ.setdefault("MPLBACKEND", "Agg")
# Triton kernels run in Triton's CPU interpreter where there is no GPU; it must be chosen before
# any kernel is defined (quant.triton_kernels reads it when imported).
# Quantizer kernels stay eager unless a test asks for torch.compile (background compiles would
# compete for the 2 cores and hold each test process's exit until done).
os.environ.setdefault("QUANT_COMPILE", "0")
os.environ.setdefault("TRITON_INTERPRET", "0" if os.path.exists("/dev/nvidia0") else "1")

import pytest
import torch

torch.set_num_threads(1)

#: The slow tiers: marker -> what it means. Each of them implies ``slow``.
TIER_MARKERS = {
    "megatron": "builds or trains real megatron-core models (seconds each, imports megatron)",
    "multiprocess": "starts processes: torchrun / gloo process groups, worker pools, child commands",
    "browser": "opens the HTML report in headless Chromium",
}

#: "module.py", "module.py::test_name" or "module.py::fixture_name" (every test of that module
#: using the fixture); fnmatch patterns, parameters ignored -> slow tiers.
SLOW_TIERS = {
    "test_capture_megatron.py": ("megatron",),
    "test_te_integration.py::test_tiny_llama_*": ("megatron",),
    "test_te_real.py": ("multiprocess",),     # TE's wheel (cached), one process per version
    "test_te_megatron_lm.py::test_mistakes_are_one_line": ("multiprocess",),
    "test_capture_patch_versions.py::test_release_*": ("megatron",),  # downloads each release
    "test_capture_driver.py": ("megatron", "multiprocess"),     # the capture runtime
    "test_capture_numerics.py::test_tiny_llama_*": ("megatron", "multiprocess"),
    "test_capture_fusion.py::fusion": ("megatron", "multiprocess"),
    "test_capture_schedule.py::sched": ("megatron", "multiprocess"),
    "test_diagnose_runtime.py": ("megatron", "multiprocess"),  # 2 ranks x 4 scenarios, ~60 s
    "test_diagnose_training.py": ("megatron", "multiprocess"),  # 4 llama-train runs, ~80 s
    "test_capture_recorder_run.py": ("megatron", "multiprocess"),  # llama-train in recorder mode
    "test_diagnose_recorder.py::three_ranks": ("megatron", "multiprocess"),  # 3-rank torchrun
    "test_diagnose_spark.py": ("multiprocess",),             # a local Spark JVM, ~20 s
    "test_capture_schedule.py::test_pipelining_*": ("megatron", "multiprocess"),
    "test_emulation_consistency.py::both_paths": ("megatron", "multiprocess"),
    "test_capture_megatron.py::test_tp2_*": ("multiprocess",),
    "test_training_driver.py": ("megatron",),
    "test_training_driver.py::test_tensor_and_data_parallel_*": ("multiprocess",),
    "test_training_driver.py::test_cli_port_in_use": ("multiprocess",),
    "test_training_scripts.py::test_embedded_*": ("megatron", "multiprocess"),
    "test_training_scripts.py::test_ctrl_c_*": ("megatron", "multiprocess"),
    "test_training_scripts.py::test_collector_*": ("multiprocess",),
    "test_training_scripts.py::test_example_script_*": ("megatron", "multiprocess"),
    "test_training_scripts.py::test_torchrun_*": ("megatron", "multiprocess"),
    "test_profiler_layer_diff.py::test_megatron_*": ("megatron",),
    "test_profiler_layer_diff.py::test_watch_training_on_megatron_*": ("megatron",),
    "test_viz_report.py::built": ("multiprocess",),      # the full report with a worker pool
    "test_viz_report.py::test_report_in_headless_chromium": ("browser", "multiprocess"),
    "test_viz_numerics.py::test_interactive_view_in_headless_chromium_*": ("browser",),
    "test_viz_numerics.py::test_tiny_llama_*": ("megatron", "multiprocess", "browser"),
    "test_viz_badinput.py::test_scripts_run_from_repo_root": ("multiprocess",),
    "test_viz_badinput.py::test_workers_when_threads_run": ("multiprocess",),
    "test_scaling_cli.py::test_runs_as_a_file_*": ("multiprocess",),
    "test_attribution_run.py": ("megatron", "multiprocess"),
    "test_quant_compiled.py::test_exit_during_*": ("multiprocess",),
    "test_viz_workers.py": ("multiprocess",),     # worker pools, report commands, signals
    # the launcher on a stand-in Megatron-LM checkout (bash, preflight processes)
    "test_megatron_lm_launcher.py::test_dry_run_*": ("multiprocess",),
    "test_megatron_lm_launcher.py::test_mistakes_*": ("multiprocess",),
    "test_megatron_lm_launcher.py::test_the_driver_*": ("multiprocess",),
    "test_megatron_lm_launcher.py::test_a_missing_package_*": ("multiprocess",),
    "test_megatron_lm_launcher.py::test_a_child_process_*": ("multiprocess",),
    "test_megatron_lm_launcher.py::test_apply_patches_*": ("multiprocess",),
    "test_cli_processes.py": ("multiprocess",),   # every installed command as a process, ~80 s
    "test_readme_order.py::test_readme_commands_pass_in_a_fresh_clone": ("multiprocess",),
}

#: Modules whose tests compare floating-point results (quantizers, statistics, metrics, merges):
#: marked ``numerics``. CI runs them a second time with another processor's arithmetic
#: (``ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 MKL_CBWR=COMPATIBLE``: PyTorch's unvectorized
#: kernels, one thread, MKL's most generic code path), so a tolerance tighter than its error
#: bound (tests/error_bounds.py) fails here, not on the next user's machine.
NUMERICS_MODULES = (
    "test_quant_*.py", "test_capture_stats*.py", "test_capture_recorder.py",
    "test_capture_numerics.py", "test_capture_tensorboard.py", "test_scaling_sweep.py",
    "test_numerics_truth.py", "test_diagnose.py", "test_diagnose_recorder.py",
    "test_architecture_walks.py", "test_te_integration.py", "test_attribution_stats.py",
    "test_profiler_tensor.py", "test_profiler_layer_diff.py", "test_emulation_consistency.py",
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: not in the fast tier (-m 'not slow'); CI runs it")
    config.addinivalue_line("markers", "numerics: compares floating-point results; CI runs these "
                            "again with another processor's arithmetic")
    for name, meaning in TIER_MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning} (slow tier)")


def _tiers(item: pytest.Item) -> set[str]:
    module = os.path.basename(str(item.fspath))
    name = getattr(item, "originalname", item.name)
    keys = [module, f"{module}::{name}"] + [f"{module}::{f}" for f in getattr(item, "fixturenames", ())]
    found = {m.name for m in item.iter_markers() if m.name in TIER_MARKERS}
    for pattern, tiers in SLOW_TIERS.items():
        if any(fnmatch.fnmatchcase(k, pattern) for k in keys):
            found.update(tiers)
    return found


@pytest.hookimpl(tryfirst=True)  # before -m deselects, so "not slow" sees these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(fnmatch.fnmatchcase(os.path.basename(str(item.fspath)), m) for m in NUMERICS_MODULES):
            item.add_marker("numerics")
        tiers = _tiers(item)
        for name in sorted(tiers):
            item.add_marker(name)
        if tiers and not item.get_closest_marker("slow"):
            item.add_marker("slow")


#: process-group variables that megatron_env.init_distributed sets in-process
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def _restore(saved: dict) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def _restore_distributed_env():
    """A test that initialised a process group in-process leaves MASTER_PORT etc. behind; a later
    test would then see that (possibly busy) port as the user's choice. Restore them."""
    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    yield
    _restore(saved)


@pytest.fixture(autouse=True, scope="module")
def _restore_distributed_env_per_module():
    """The same for module-scoped fixtures that start a process group (their port stays busy
    until the module ends)."""
    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    yield
    _restore(saved)
