"""A correct bf16 autocast training loop: no finding is expected here."""
import torch
import torch.nn.functional as F


def train_step(model, batch, optimizer, scheduler):
    tokens, labels = batch
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach().float(), grad_norm


def evaluate(model, loader):
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for tokens, labels in loader:
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                logits = model(tokens)
                probs = F.softmax(logits, dim=-1)
                nll = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
            total += nll.item()
            count += labels.numel()
    return total / count, probs
