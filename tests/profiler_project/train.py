"""A training script whose scaler, autocast, loss and model all come from its package."""
from trainer_pkg import losses
from trainer_pkg.amp_setup import LossScaler, autocast_for
from trainer_pkg.model import TinyAttention


def main(loader, opt, device="cuda"):
    model = TinyAttention(64)
    scaler = LossScaler()
    amp_ctx = autocast_for(device, True)
    for x, mask, y in loader:
        with amp_ctx:
            logits = model(x, mask)
        loss = losses.lm_loss(logits, y)  # expect: AMP003
        scaler(loss, opt, clip=1.0, params=model.parameters())
