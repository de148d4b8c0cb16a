"""long-reduction-in-fp16: linear attention sums feature maps over the whole sequence in the
activations' float16 and divides by that sum (bug xformers-favor-fp16-overflow)."""
import torch


def linear_attention(q_prime, k_prime, v):
    kv = torch.einsum("bnd,bne->bde", k_prime, v)  # expect: AMP019
    norm = torch.einsum("bnd,bd->bn", q_prime, k_prime.sum(dim=1))
    return torch.einsum("bnd,bde->bne", q_prime, kv) / norm.unsqueeze(-1)


def train_step(model, batch, optimizer):
    model.half()
    loss = model(batch).float().mean()
    loss.backward()
    optimizer.step()
