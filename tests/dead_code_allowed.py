"""Names the dead-code check (tests/test_dead_code.py) accepts although no code of ours reads them.

Each is something a framework calls or reads, a public API the docs name, or data a record
carries; the comment says which. tests/test_dead_code.py fails on an entry no longer needed
(nothing of that name is unused any more), so the list cannot outlive the code.

The vulture whitelist format: ``python -m vulture <packages> tests/dead_code_allowed.py`` works
too. Never imported by the code; ``_`` only swallows the attribute reads if it is.
"""


class _Names:
    def __getattr__(self, name: str) -> None:
        return None


_ = _Names()

# ---- called or read by a framework, by its name --------------------------------------------
# Python: a module's lazy exports (PEP 562: quant/__init__.py, training_profiler/__init__.py);
# the fork-safe worker start clears __main__.__spec__ (tensor_viz/workers.py)
_.__getattr__
_.__spec__
# ast.NodeVisitor dispatches visit_<NodeType> (training_profiler/amp_checker/scopes.py, rules/)
_.visit_AnnAssign
_.visit_NamedExpr
# shlex.shlex settings the tokenizer reads (training_profiler/amp_checker/launch_rules.py)
_.whitespace_split
_.commenters
# tqdm reads the class attribute to start its monitor thread (tensor_viz/file_reads.py)
_.monitor_interval
# Hugging Face tokenizers: a Tokenizer's pre-tokenizer and decoder (training_driver/data/tokenizer.py)
_.pre_tokenizer
_.decoder
# megatron-core's MegatronTokenizerBase interface (training_driver/data/tokenizer.py's adapter):
# the dataset cache key, decoding, and the abstract chat-template method
_.unique_identifiers
_.detokenize
_.apply_chat_template
# Transformer Engine's Quantizer / QuantizedTensorStorage interface (te_integration/te_quantizer.py):
# TE calls these on our custom quantizer and its tensors
_.prepare_for_saving
_.restore_from_saved
_.get_usages
_._scale_inv
_.supports_allgather_fp8
_.is_requantization_safe
_.make_empty
_.transpose_qresult
_._get_compatible_recipe
_.qgemm
# ... and the parameters of those signatures TE passes and our emulation does not need
_.pin_memory
_.m_params
_.sx
_.gemm_type
_.qresult_x
_.qresult_w
# TE reads this flag on a parameter with main_grad (bench/te_gpu_check.py sets it as Megatron does)
_.grad_added_to_main_grad
# nvdlfw-inspect's namespace API (te_integration/namespace.py: our `lowp` namespace): the
# attributes and hooks its API class must have, and the hook parameters it passes
_._default_api_impl
_._cacheable_api_kwargs_map
_.input_assertions_hook
_.routing_condition
_.output_assertions_hook
_.is_multiple_feature_invocation_allowed
_.handle_multi_feature_output
_.features_to_invoke
# nvdlfw-inspect feature hooks' keyword parameters (te_integration/features.py)
_.tp_group
_.tp_size
_.columnwise_quantized_tensor
# Megatron-LM / TE's CustomRecipe call it by the dotted path given on the command line
# (--fp8-quantizer-factory te_integration.factory.quantizer_factory; README, docs/te.md)
_.quantizer_factory

# ---- held only to keep an object alive ---------------------------------------------------------
# STATE.agreement_work: the budget stop's all-reduce handle, so no gloo thread frees its tensor
# while the interpreter exits (tensor_capture/budget.py any_rank says why)
_.agreement_work

# ---- looked up by name in a table --------------------------------------------------------------
# tensor_viz/options.py: each report section names its drawing function as "module:function"
_.draw_distributions
_.draw_heatmaps
_.draw_comparisons
_.draw_statistics
_.draw_attention_analysis
_.draw_attention_maps
_.draw_quantization
_.draw_layers
_.draw_overflow
_.draw_fp8
_.draw_bf16
_.draw_backward
_.draw_ranks
_.draw_numerics
_.draw_run_timeline

# ---- fields written out whole (dataclasses.fields / asdict / a key list) ----------------------
# quant.analysis.QuantAnalysis.to_dict() (fields()): the manifest's quant_analysis, the index's columns
_.absmax_before
_.absmax_after
_.min_nonzero_before
_.min_nonzero_after
_.flush_to_zero_severity
# quant.formats.FormatSpec.summary() (getattr over a key list; docs/quant.md's table)
_.inf_encoding
_.nan_encoding
# tensor_capture.schema.TensorName.to_dict() (asdict): every record's schema_version
_.schema_version
# tensor_capture.patch_edits.Family: each Megatron release family must state what differs from
# the previous one (read by the maintainer who adds the next family, beside its edits)
_.differs

# ---- the record schema's key lists, held to the writer and the index by a test ----------------
# tests/test_capture_schema_index.py checks every manifest record against RECORD_KEYS and the
# columnar index's columns against them minus the documented exemptions (docs/architecture.md)
_.RECORD_KEYS
_.JSON_ONLY
_.ANALYSIS_JSON_ONLY

# ---- public API the docs name ------------------------------------------------------------------
# quant/mxfp.py's helper by element-format name (docs/quant.md)
_.quant_mx
# FormatSpec.value_set(): every finite value of a <= 8-bit format (docs/quant.md)
_.value_set
# the Python reference of the merged std the SQL computes (docs/diagnose.md, reference_gap)
_.merge_moments
# a whole realistic synthetic run for trying the report without a GPU (docs/capture.md)
_.write_synthetic_run
# each figure's layout self-check, kept on its record (docs/visualization.md, "Readable layout")
_.layout_issues
# training_profiler's exports (its __all__; README and docs/profiler.md name audit_precision)
_.audit_precision

# the static checker on a source string (docs/amp_checker.md, its layout table)
_.check_source

# ---- case scripts: what their docs and the tools read ------------------------------------------
# skills/numerical_issues/case_masked_softmax_fp16.train_demo: the loop the case comes from, kept
# as code for amp-static-check to find (tests/test_profiler_skills.py's STATIC); never run
_.train_demo
# skills/numerical_issues/case_outlier_saturation.OUTLIER_LAYER: the layer the case plants its
# outlier in, the answer its detector must name (the case's documented expectation)
_.OUTLIER_LAYER
