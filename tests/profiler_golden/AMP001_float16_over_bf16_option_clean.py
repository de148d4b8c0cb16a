import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, BitsAndBytesConfig


def parse(parser):
    parser.add_argument("--bf16", action="store_true")


def quantization_config(args):
    compute_dtype = torch.bfloat16 if args.bf16 else torch.float16   # a precision choice
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=compute_dtype)


def merge_and_save(model, out_dir, torch_dtype):
    model = model.merge_and_unload()
    model.to(dtype=torch_dtype)
    model.save_pretrained(out_dir)


def build_for_generation(task, cfg):
    return task.build_model(cfg.model).to(cfg.dtype).cuda()


def load_adapter(model, path, dtype):
    return PeftModel.from_pretrained(model, path, torch_dtype=dtype)


def shard_dtype(shards):
    dtype = torch.float16                                           # a default, set again below
    for k in shards:
        dtype = shards[k].dtype
    return dtype
