import torch


def train(model, loader, optimizer, use_fp16):
    scaler = torch.amp.GradScaler("cuda", enabled=use_fp16)
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16, enabled=use_fp16):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
