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
            if use_amp:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()


def step_elsewhere(model, batch, optimizer, scaler, update):
    scaler.scale(model(batch).float().mean()).backward()
    update(optimizer, scaler)     # the helper is handed the scaler: it may step through it
    optimizer.step


def run(model, loader):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_epoch(model, loader, optimizer, torch.amp.GradScaler("cuda"))
