import torch
import torch.nn.functional as F

EPS = 1e-6


def reward_loss(model, chosen_ids, rejected_ids):
    chosen, rejected = model(chosen_ids), model(rejected_ids)
    return -F.logsigmoid(chosen - rejected).mean()


def focal_cost(out_prob):
    pos = -(out_prob + EPS).log()
    neg = -(1 - out_prob.float() + 1e-8).log()                       # upcast first: 1e-8 holds in float32
    return pos - neg


def token_logprobs(logits):
    return torch.log(torch.softmax(logits, dim=-1, dtype=torch.float32))


def train(model, batches, optimizer):
    scaler = torch.amp.GradScaler("cuda")
    for chosen_ids, rejected_ids in batches:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = reward_loss(model, chosen_ids, rejected_ids)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
