"""Low-precision numerics toolkit for Megatron-LM: capture, emulation, visualization, monitoring.

Install with ``pip install -e .`` (torch first: ``pip install torch==2.13.0`` on a CPU machine).
Packages: lowp_common (console-command helpers), quant (numerics core), quant_tools (its
command-line applications), te_integration (Transformer Engine custom recipe and debug-API
features), tensor_capture (what
megatron/core/tensor_saver.py uses), tensor_viz (plots and reports), training_driver (training on megatron-core),
training_profiler (static checker, monitor, analyzers).
"""
from setuptools import find_packages, setup

setup(
    name="megatron-lowp-tools",
    version="0.1.0",
    description="Capture, emulate and visualize FP8/MXFP/HiFP8 numerics in Megatron-LM training",
    python_requires=">=3.10",
    packages=find_packages(
        include=["attribution", "attribution.*", "lowp_common", "lowp_common.*", "quant", "quant.*", "quant_tools", "quant_tools.*", "te_integration", "tensor_capture",
                 "tensor_capture.*", "tensor_viz", "tensor_viz.*", "training_driver", "training_driver.*", "training_profiler",
                 "training_profiler.*"]
    ),
    # te_integration/debug_features/ is a feature folder nvdlfw-inspect executes file by file
    # (no __init__.py on purpose): shipped as data beside the package
    package_data={"training_profiler": ["skills/*/README.md"], "tensor_viz": ["templates/*.j2", "templates/*.css"],
                  "te_integration": ["debug_features/*.py"], "quant": ["sweep_verdicts.json"]},
    install_requires=[
        # A range, not a pin: users bring their own CUDA build of torch.
        "torch>=2.4",
        "megatron-core>=0.12",
        "numpy>=1.24",
        "matplotlib>=3.7",
        "tqdm>=4.60",
        "pyyaml>=6.0",
        "jinja2>=3.0",
        # preprocess-corpus trains a byte-level BPE with it; small abi3 wheels, no torch.
        "tokenizers>=0.15",
        # the report's columnar index of the manifests (tensor_viz.columnar): Parquet + DuckDB
        "pyarrow>=14",
        "duckdb>=1.1",
    ],
    extras_require={
        "test": ["pytest>=7", "ruff==0.17.6", "hypothesis>=6", "ml_dtypes>=0.5", "en_dtypes>=0.0.4",
                 # the dead-code check (tests/test_dead_code.py)
                 "vulture==2.16",
                 "safetensors>=0.4", "scipy>=1.10", "tensorboard>=2.10",
                 # the tests load our tokenizer as Megatron-LM does (AutoTokenizer); no torch pulled
                 "transformers>=4.40",
                 # the Triton kernels are tested on the CPU in its interpreter (TRITON_INTERPRET=1)
                 "triton>=3.2",
                 # the Transformer Engine debug features (te extra)
                 "nvdlfw-inspect==0.2.2",
                 # TE's own Python (its wheel, fetched by tests/test_te_real.py) imports these
                 # at import time; pure Python (onnx: a small binary wheel), no CUDA, no torch
                 "onnxscript>=0.5", "einops>=0.8",
                 # lowp-diagnose's queries as Spark SQL (local mode; needs a Java runtime)
                 "pyspark>=3.5",
                 # the real pretrain_gpt.py of Megatron-LM (tests/test_megatron_lm_real.py):
                 # the megatron-lm extra below
                 "six", "psutil", "pybind11"],
        # Transformer Engine's debug API (pure Python): our features in it (te_integration);
        # Transformer Engine itself (>= 2.16 for the quantizer factory) comes from the gpu extra
        "te": ["nvdlfw-inspect==0.2.2"],
        # GPU-only extras; nothing imports them unconditionally.
        "gpu": ["transformer-engine[pytorch]"],
        "tensorboard": ["tensorboard>=2.10"],
        # lowp-diagnose over a cluster's Parquet dataset (tensor_viz.diagnose.spark)
        "spark": ["pyspark>=3.5"],
        # what Megatron-LM's training loop (pretrain_gpt.py, MEGATRON_LM_DIR) imports beyond
        # megatron-core: six (its BERT tokenizer module), psutil (the checkpoint writer; without
        # it training waits forever), pybind11 (its dataset helpers), transformers (the tokenizer)
        "megatron-lm": ["six", "psutil", "pybind11", "transformers>=4.40"],
        "safetensors": ["safetensors>=0.4"],
    },
    entry_points={
        "console_scripts": [
            "quant-demo=quant_tools.demo:main",
            "mxfp-scaling-test=quant_tools.scaling_cli:main",
            "megatron-tensor-patch=tensor_capture.patcher:main",
            "enhanced-tensor-visualizer=tensor_viz.analysis_cli:main",
            "quick-visualize=tensor_viz.quick_cli:main",
            "visualize-tensors=tensor_viz.full:main",
            "llama-train=training_driver.train:main",
            "preprocess-corpus=training_driver.data.preprocess:main",
            "amp-static-check=training_profiler.amp_checker.checker:main",
            "analyze-tensor=training_profiler.tensor_analyzer:main",
            "precision-diff=training_profiler.layer_diff:main",
            "lowp-te-check=te_integration.check_cli:main",
            "lowp-attribute=attribution.cli:main",
            "lowp-diagnose=tensor_viz.diagnose.cli:main",
            "lowp-audit=training_profiler.audit.cli:main",
        ]
    },
)
