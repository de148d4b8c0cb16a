import torch


def train(model, loader, optimizer, use_fp16):
    scaler = torch.amp.GradScaler("cuda", enabled=use_fp16)
    for batch in loader:
        loss = model(**batch).loss                            # finding: nothing makes this float16
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
