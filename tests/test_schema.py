"""File-name schema: round trips, older seed formats, bad names."""
import pytest
import torch

from tensor_capture import schema
from tensor_capture.schema import TensorName, build_filename, parse_filename


def _name(**kw):
    base = dict(layer_type="linear", operation="backward", tensor_name="grad_output",
                quant_type="mxfp8_e5m2", layer_idx=3, phase="pre", component="linear",
                iteration=7, rank=1, sample_idx=2, timestamp="20250908_095220", counter=12)
    base.update(kw)
    return TensorName(**base)


@pytest.mark.parametrize("kw", [{}, {"layer_idx": None}, {"sample_idx": None, "rank": None},
                                {"quant_type": "hifp8", "tensor_name": "query"},
                                {"counter": 123456}])
def test_round_trip(kw):
    n = _name(**kw)
    assert parse_filename(build_filename(n)) == n


def test_seed_item6_example_shape():
    f = build_filename(_name(quant_type="hifp8", tensor_name="input", counter=5, layer_idx=1,
                             iteration=0, rank=0, sample_idx=0, operation="forward"))
    assert f == "20250908_095220_0005_iter0_linear_L1_forward_pre_linear_hifp8_rank0_sample0_input.pt"


def test_v2_and_v1_names_parse():
    v2 = parse_filename("20250908_095220_0008_linear_L1_backward_pre_linear_hifp8_input.pt")
    assert (v2.layer_idx, v2.operation, v2.phase, v2.component, v2.quant_type, v2.tensor_name,
            v2.schema_version) == (1, "backward", "pre", "linear", "hifp8", "input", 2)
    v1 = parse_filename("20250908_092156_0004_attention_L0_forward_hifp8_output.pt")
    assert (v1.layer_type, v1.layer_idx, v1.quant_type, v1.tensor_name, v1.phase) == (
        "attention", 0, "hifp8", "output", "unknown")
    v1b = parse_filename("20250908_092156_0004_linear_forward_fp8_e4m3_grad_input.pt")
    assert (v1b.quant_type, v1b.tensor_name, v1b.layer_idx) == ("fp8_e4m3", "grad_input", None)


@pytest.mark.parametrize("bad", ["model.pt", "20250908_0001_linear.pt", "notes.txt", ""])
def test_foreign_names_rejected(bad):
    with pytest.raises(ValueError):
        parse_filename(bad)
    assert not schema.is_tensor_filename(bad)


def test_bad_fields_rejected():
    with pytest.raises(ValueError, match="tensor_name"):
        build_filename(_name(tensor_name="a/b"))
    with pytest.raises(ValueError, match="phase"):
        build_filename(_name(phase="pre_x"))


def test_manifest_append_and_torn_line(tmp_path):
    schema.append_manifest(tmp_path, 0, {"a": 1})
    schema.append_manifest(tmp_path, 1, {"a": 2})
    with open(schema.manifest_path(tmp_path, 1), "a") as fh:
        fh.write('{"a": 3')  # a crash mid-line
    assert sorted(r["a"] for r in schema.read_manifest(tmp_path)) == [1, 2]


def test_load_tensor_file_kinds(tmp_path):
    t = torch.arange(6, dtype=torch.bfloat16)
    good = tmp_path / build_filename(_name())
    torch.save({"tensor": t, "metadata": {"iteration": 7}}, good)
    tensor, meta = schema.load_tensor_file(good)
    assert torch.equal(tensor, t) and meta["iteration"] == 7
    bare = tmp_path / "20250908_092156_0004_attention_L0_forward_hifp8_output.pt"
    torch.save(t, bare)
    assert schema.load_tensor_file(bare)[1]["layer_idx"] == 0
    (tmp_path / "trunc.pt").write_bytes(good.read_bytes()[:50])
    with pytest.raises(ValueError, match="trunc.pt"):
        schema.load_tensor_file(tmp_path / "trunc.pt")
    torch.save({"x": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="other.pt"):
        schema.load_tensor_file(tmp_path / "other.pt")


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_code_running_pickle_refused(tmp_path, capsys):
    p = tmp_path / "evil.pt"
    torch.save({"tensor": torch.zeros(1), "metadata": _Evil()}, p)
    with pytest.raises(schema.UnsafeTensorFileError, match="evil.pt") as err:
        schema.load_tensor_file(p)
    assert "could run code" in str(err.value)
    assert "weights_only" not in str(err.value)  # never relay torch's advice to load unsafely
    assert "pwned" not in capsys.readouterr().out
