import torch


def calc_grad_norm(parameters, p=2.0):
    parameters = [par for par in parameters if par.grad is not None]
    return torch.norm(torch.stack([torch.norm(par.grad.detach(), p, dtype=torch.float32) for par in parameters]), p)


def total_norm_squared(model):
    total = 0.0
    for param in model.parameters():
        param_norm = param.grad.data.float().norm(2)
        total += param_norm.item() ** 2
    return total ** 0.5


def log_norms(model, log):
    for name, param in model.named_parameters():
        log(name, param.grad.norm())                          # one norm, not a total


class PureFp16Adam(torch.optim.Adam):
    def __init__(self, params, **kw):
        params = list(params)
        assert params[0].dtype == torch.float16
        super().__init__(params, **kw)
