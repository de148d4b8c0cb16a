"""te_integration.megatron_lm: our TE debug features in a Megatron-LM run without the
``--tensor-inspect*`` flags (Megatron-LM pull request #3811 only).

Megatron-LM's training loop is not installed here: the hooks are checked on a module holding
the two function names the entry point wraps in ``megatron.training.training``
(``setup_model_and_optimizer``, ``train_step``), shaped as Megatron-LM main d98e8a6 has them
(pretrain_gpt.py passes a config container, and the model is built by its builder without
get_model), and a real torch model; the debug API is nvdlfw-inspect's, with
our feature folder and the TE-namespace stand-in (TE's real namespace: test_te_real.py).
"""
from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("nvdlfw_inspect", reason="nvdlfw-inspect (the te extra) is not installed")

import nvdlfw_inspect.api as debug_api
from te_helpers import FEATURE_DIR, ROOT, STANDIN_DIR

from te_integration import megatron_lm

YAML = """
fc1:
  enabled: True
  layers:
    layer_name_regex_pattern: .*fc1$
  transformer_engine:
    LowpWhatIf:
      enabled: True
      tensors: [activation]
      formats: [mxfp8]
"""


@pytest.fixture(autouse=True)
def _clean_debug_api():
    debug_api.end_debug()
    yield
    debug_api.end_debug()


def _training_module(calls: list) -> types.SimpleNamespace:
    def get_model(provider, model_type=None, wrap_with_ddp=True):
        calls.append(("get_model",))
        return [torch.nn.Sequential(torch.nn.Linear(4, 4))]

    def setup_model_and_optimizer(model_type, model_provider_func=None, *, cfg_container=None):
        # Megatron-LM main: with a config container the builder makes the model, no get_model
        calls.append(("setup", debug_api.DEBUG_MANAGER is not None))
        if cfg_container is None:
            model = get_model(model_provider_func, model_type)
        else:
            model = [torch.nn.Sequential(torch.nn.Linear(4, 4))]
        return model, "optimizer", "scheduler"

    def train_step(*args, **kwargs):
        calls.append(("train_step",))
        return "loss"

    return types.SimpleNamespace(get_model=get_model, train_step=train_step,
                                 setup_model_and_optimizer=setup_model_and_optimizer)


@pytest.mark.parametrize("container", [True, False], ids=["config_container", "get_model"])
def test_hooks_initialize_before_the_model_name_layers_after_and_step(tmp_path, container):
    (tmp_path / "inspect.yaml").write_text(YAML)
    calls: list = []
    training = _training_module(calls)
    megatron_lm.install_hooks(str(tmp_path / "inspect.yaml"), str(tmp_path / "logs"),
                              [str(FEATURE_DIR), str(STANDIN_DIR)], training)
    model, _, _ = training.setup_model_and_optimizer(
        "encoder_or_decoder", lambda: None, cfg_container=object() if container else None)
    assert calls[0] == ("setup", True)             # initialized before the model was built
    assert model[0][0].name == "model.0"           # nvdlfw-inspect's name, what the YAML matches
    assert training.train_step() == "loss" and training.train_step() == "loss"
    assert debug_api.DEBUG_MANAGER._trainer_iteration_count == 2


def test_a_step_with_no_named_model_is_refused_in_one_line(tmp_path):
    training = _training_module([])
    megatron_lm.install_hooks(None, str(tmp_path / "logs"), [], training)
    with pytest.raises(megatron_lm.UserError, match="no layer was named"):
        training.train_step()


def test_without_a_config_only_te_layers_are_named_by_module_path():
    te_like = type("Linear", (torch.nn.Linear,), {"__module__": "transformer_engine.pytorch.module.linear"})
    # Megatron's wrapper class lives in megatron.core.extensions.transformer_engine
    wrapper = type("TERowParallelLinear", (te_like,), {"__module__": "megatron.core.extensions.transformer_engine"})
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.fc2 = wrapper(4, 4)
    model.decoder.fc2.name = None
    model.decoder.norm = torch.nn.LayerNorm(4)
    assert megatron_lm.name_te_layers(model) == 1
    assert model.decoder.fc2.name == "decoder.fc2" and not hasattr(model.decoder.norm, "name")


def test_the_script_runs_with_its_arguments_and_folder_first(tmp_path, monkeypatch):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("import sys, json\nopen(sys.argv[1], 'w').write(json.dumps([sys.argv, sys.path[0]]))\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    out = tmp_path / "out.json"
    megatron_lm.run_script(str(script), [str(out), "--num-layers", "2"])
    import json

    argv, first = json.loads(out.read_text())
    assert argv == [str(script), str(out), "--num-layers", "2"] and first == str(tmp_path)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "te_integration.megatron_lm", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case", ["no-script", "custom-recipe", "bad-yaml", "checkout",
                                  "grouped-gemm"])
def test_mistakes_are_one_line(tmp_path, case):
    (tmp_path / "inspect.yaml").write_text(YAML)
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("raise SystemExit('must not run')\n")
    args, words = {
        "no-script": (["--inspect-config", str(tmp_path / "inspect.yaml"), str(tmp_path / "nope.py")],
                      "no such file"),
        "custom-recipe": (["--inspect-config", str(tmp_path / "inspect.yaml"), str(script),
                           "--fp8-recipe", "custom"], "cannot run while TE's debug API"),
        "bad-yaml": (["--inspect-config", str(tmp_path / "missing.yaml"), str(script)], "no such file"),
        "checkout": (["--check-checkout", str(tmp_path)], "has no --fp8-quantizer-factory"),
        # before any step: the factory itself would refuse only at the first forward
        "grouped-gemm": ([str(script), "--fp8-recipe", "custom", "--num-experts", "4",
                          "--moe-grouped-gemm"], "cannot emulate Transformer Engine's GroupedLinear"),
    }[case]
    out = _cli(*args)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert words in out.stderr


def test_checkout_with_the_factory_flag_passes(tmp_path):
    args = tmp_path / "megatron" / "training" / "arguments.py"
    args.parent.mkdir(parents=True)
    args.write_text("group.add_argument('--fp8-quantizer-factory', type=str)\n")
    assert "available" in megatron_lm.check_checkout(str(tmp_path))
