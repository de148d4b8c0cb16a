"""Loads the CPU stand-ins for Megatron-LM's training loop in every process of a test's run.

Python imports ``sitecustomize`` at start-up from ``PYTHONPATH``, so torchrun's ranks and
Megatron's checkpoint-writer processes all get the stand-ins; the tests that run the real
``pretrain_gpt.py`` put this folder on ``PYTHONPATH`` and set the variables below.
"""
import os

if os.environ.get("LOWP_MEGATRON_LM_CPU_STANDINS") == "1":
    import megatron_lm_cpu_standins

    megatron_lm_cpu_standins.install()
if os.environ.get("LOWP_TEST_PLANT_NAN"):
    import plant_nan

    plant_nan.install(os.environ["LOWP_TEST_PLANT_NAN"])
if os.environ.get("LOWP_TEST_PLANT_SCALE"):
    import plant_nan

    plant_nan.install_scale(os.environ["LOWP_TEST_PLANT_SCALE"])
