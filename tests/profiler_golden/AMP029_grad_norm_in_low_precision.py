import torch


def calc_grad_norm(parameters, p=2.0):
    parameters = [par for par in parameters if par.grad is not None]
    return torch.norm(torch.stack([torch.norm(par.grad.detach(), p) for par in parameters]), p)   # finding


def total_norm_squared(model):
    total = 0.0
    for param in model.parameters():
        param_norm = param.grad.data.norm(2)                  # finding: inf above 65504 in float16
        total += param_norm.item() ** 2
    return total ** 0.5


class PureFp16Adam(torch.optim.Adam):
    def __init__(self, params, **kw):
        params = list(params)
        assert params[0].dtype == torch.float16               # the project has float16 parameters
        super().__init__(params, **kw)
