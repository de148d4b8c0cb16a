"""A script beside the package that imports nothing from it: the package's float16 training
does not vouch for its BCE (a folder of scripts is not one program)."""
import torch


def train_gan(d, x, y, opt):
    loss = torch.nn.functional.binary_cross_entropy(torch.sigmoid(d(x)), y)
    loss.backward()
    opt.step()
