"""low-precision-cast-of-trained-params: validation casts a pipeline that shares the module being
trained, so its fp32 trainable weights become fp16 mid-training (bugs diffusers-lora-validation-cast, diffusers-lora-sdxl-validation-cast)."""
import torch


def validate(pipeline, device, dtype):
    pipeline = pipeline.to(device, dtype=dtype)  # expect: AMP001
    return pipeline(num_steps=10)


def train(net, pipeline, loader, optimizer, device):
    scaler = torch.amp.GradScaler("cuda")
    weight_dtype = torch.float16
    pipeline.net = net
    for step, batch in enumerate(loader):
        with torch.autocast("cuda", dtype=weight_dtype):
            loss = net(batch).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step % 500 == 0:
            validate(pipeline, device, weight_dtype)
