"""A training script whose scaler, autocast and loss all come from its package."""
from trainer_pkg import losses
from trainer_pkg.amp_setup import LossScaler, autocast_for


def main(model, loader, opt, device="cuda"):
    scaler = LossScaler()
    amp_ctx = autocast_for(device, True)
    for x, y in loader:
        with amp_ctx:
            logits = model(x)
        loss = losses.lm_loss(logits, y)  # expect: AMP003
        scaler(loss, opt, clip=1.0, params=model.parameters())
