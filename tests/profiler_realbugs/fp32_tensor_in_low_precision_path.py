"""fp32-tensor-in-low-precision-path: helper tensors made in the default float32 meet half-precision
activations (bugs mmcv-three-interpolate-fp32-buffer, mmcv-generalized-attention-fp32-positions, litgpt-kvcache-buffer-dtype)."""
import torch
from torch import nn


class CoordConcat(nn.Module):
    def forward(self, feats):
        n, _, h, w = feats.shape
        ys = torch.linspace(-1, 1, h, device=feats.device)  # expect: none-covers
        xs = torch.linspace(-1, 1, w, device=feats.device)  # expect: none-covers
        grid = torch.stack(torch.meshgrid(ys, xs, indexing="ij")).expand(n, -1, -1, -1)
        return torch.cat([feats, grid], dim=1)


def build(device):
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), CoordConcat()).to(device, dtype=torch.float16)
