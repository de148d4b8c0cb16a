import torch


def prepare(model, fp16: bool):
    if fp16:
        model.forward = torch.autocast("cuda", dtype=torch.float16)(model.forward)   # finding
    return model


def convert_outputs(fn):
    def wrapped(*args, **kwargs):
        return fn(*args, **kwargs).float()
    return wrapped


def prepare_right(model):
    model.forward = convert_outputs(torch.autocast("cuda")(model.forward))    # no finding: outputs float32
    return model
