import torch

EPS = 1e-8


def reward_loss(model, chosen_ids, rejected_ids):
    chosen, rejected = model(chosen_ids), model(rejected_ids)
    return -torch.log(torch.sigmoid(chosen - rejected)).mean()     # finding: -inf from a margin of 17


def focal_cost(out_prob):
    pos = -(out_prob + EPS).log()                                    # finding: EPS is 0 in float16
    neg = -(1 - out_prob + 1e-8).log()                               # finding
    return pos - neg


def train(model, batches, optimizer):
    scaler = torch.amp.GradScaler("cuda")
    for chosen_ids, rejected_ids in batches:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = reward_loss(model, chosen_ids, rejected_ids)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
