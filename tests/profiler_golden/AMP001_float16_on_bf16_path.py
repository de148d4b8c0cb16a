import torch
from transformers import AutoModelForCausalLM


def load(cfg):
    torch_dtype = torch.float16 if cfg.fp16 or cfg.bf16 else torch.float32   # finding: bf16 asked, fp16 given
    return AutoModelForCausalLM.from_pretrained(cfg.base_model, torch_dtype=torch_dtype)


def load_adapter_base(cfg):
    if cfg.bf16:
        return AutoModelForCausalLM.from_pretrained(cfg.base_model, torch_dtype=torch.float16)   # finding
    return AutoModelForCausalLM.from_pretrained(cfg.base_model)
