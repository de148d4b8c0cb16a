"""Clean twin of logprobs_bf16_wrapper: the bfloat16 logits are upcast before log_softmax."""
import torch
from _tiny import Tiny, batch, seeded


def token_logprobs(model, tokens, targets):
    logits = model(tokens)
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def main(steps: int = 3) -> None:
    gen = seeded()
    model = Tiny().to(torch.bfloat16)
    master = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(master, lr=1e-3)
    for _ in range(steps):
        tokens, targets = batch(gen)
        loss = -token_logprobs(model, tokens, targets).float().mean()
        loss.backward()
        for p, m in zip(model.parameters(), master):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(model.parameters(), master):
                p.copy_(m)


if __name__ == "__main__":
    main()
