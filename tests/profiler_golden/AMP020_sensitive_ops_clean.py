from functools import partial

import torch
import torch.nn.functional as F


def t5_encode_text(texts, name="t5-large"):
    return texts


class Rotary(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, position_ids):
        with torch.autocast("cuda", enabled=False):     # no finding: angles in float32
            freqs = self.inv_freq.float()[:, None] @ position_ids.float()[None, :]
        return freqs.cos(), freqs.sin()


class LogMel(torch.nn.Module):
    def __init__(self, n_mels):
        super().__init__()
        self.fbank = torch.nn.Linear(201, n_mels)

    @torch.autocast("cuda", enabled=False)
    def forward(self, wav, features):
        spec = torch.stft(features.float(), n_fft=400, return_complex=True).abs() ** 2   # no finding
        return torch.log(self.fbank(spec.transpose(-1, -2)) + 1e-6)


class TextToImage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encode_text = partial(t5_encode_text, name="t5-large")
        self.net = torch.nn.Linear(8, 8)

    def forward(self, texts, x):
        with torch.autocast("cuda", enabled=False):     # no finding: T5 in float32
            emb = self.encode_text(texts)
        return self.net(x) + emb


def train(model, loader, optimizer, scaler):
    for texts, x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.mse_loss(model(texts, x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


class RigidAlign(torch.nn.Module):
    def forward(self, pred, true, weights):
        with torch.autocast("cuda", enabled=False):     # no finding: covariance and SVD in float32
            cov = torch.einsum("bni,bnj->bij", (weights * true).float(), pred.float())
            u, s, v = torch.svd(cov)
        return u @ v.transpose(-2, -1)
