"""Sampling from a trained classifier: float16 autocast, no training step."""
import argparse

import torch
import torch.nn.functional as F
from tinynet import TinyNet


def predict(model, batch):
    with torch.autocast("cuda", dtype=torch.float16):
        logits = model(batch)
    probs = F.softmax(logits, dim=-1)
    return probs.argmax(dim=-1), logits.mean()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--weights", required=True)
    args = parser.parse_args()
    net = TinyNet().cuda()
    net.load_state_dict(torch.load(args.weights, weights_only=True))
    net.eval()
    for _ in range(4):
        labels, mean_logit = predict(net, torch.randn(8, 16, device="cuda"))
        print(labels.tolist(), float(mean_logit))
