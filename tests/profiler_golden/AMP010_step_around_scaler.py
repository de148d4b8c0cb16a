import torch


def train_epoch(model, loader, optimizer, scaler, use_amp=True, accum=2):
    for i, batch in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
            loss = model(batch).float().mean()
        if use_amp:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        if (i + 1) % accum == 0:
            optimizer.step()          # finding: the scaled gradients are stepped as they are
            optimizer.zero_grad()


def run(model, loader):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_epoch(model, loader, optimizer, torch.amp.GradScaler("cuda"))
