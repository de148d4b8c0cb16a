import torch
from transformers import AutoModelForCausalLM


def load(cfg):
    torch_dtype = torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32
    return AutoModelForCausalLM.from_pretrained(cfg.base_model, torch_dtype=torch_dtype)


def load_adapter_base(cfg):
    if cfg.bf16:
        return AutoModelForCausalLM.from_pretrained(cfg.base_model, torch_dtype=torch.bfloat16)
    return AutoModelForCausalLM.from_pretrained(cfg.base_model)
