"""Loss heads, no AMP in sight."""
import torch.nn.functional as F


def objectness_loss(probs, targets):
    return F.binary_cross_entropy(probs, targets)    # seed: AMP002
