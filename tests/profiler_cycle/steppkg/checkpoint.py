import torch


def save(path, model, opt):
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
