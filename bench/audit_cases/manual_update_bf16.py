"""Bug kind trainable-params-in-fp16, updated by hand (issue 48): the model is cast to bfloat16
and the loop updates the parameters itself, as pytorch/examples' word_language_model does
(``p.data.add_(p.grad, alpha=-lr)``): no optimizer step runs, and small updates round away."""
import torch
import torch.nn.functional as F
from _tiny import Tiny, batch, seeded

LR = 1e-3


def main(steps: int = 3) -> None:
    gen = seeded()
    model = Tiny().to(torch.bfloat16)
    for _ in range(steps):
        tokens, targets = batch(gen)
        loss = F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
        model.zero_grad()
        loss.backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-LR)


if __name__ == "__main__":
    main()
