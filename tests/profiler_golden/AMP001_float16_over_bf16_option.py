import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, BitsAndBytesConfig


def parse(parser):
    parser.add_argument("--bf16", action="store_true")          # the project offers bfloat16


def quantization_config():
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float16)   # finding


def merge_and_save(model, out_dir):
    model = model.merge_and_unload()
    model.to(dtype=torch.float16)                                 # finding: whatever the run trained in
    model.save_pretrained(out_dir)


def build_for_generation(task, cfg):
    return task.build_model(cfg.model).half().cuda()              # finding


class Linear(torch.nn.Module):
    def __init__(self, n_in, n_out, on_gpu=False):
        super().__init__()
        dtype = torch.half if on_gpu else torch.float             # finding: GPU init means float16
        self.weight = torch.nn.Parameter(torch.empty(n_out, n_in, dtype=dtype))


def load_adapter(model, path):
    return PeftModel.from_pretrained(model, path, torch_dtype=torch.float16)   # finding
