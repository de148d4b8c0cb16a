"""Times float16 training steps of TinyNet on random data; keeps nothing."""
import time

import torch
from tinynet import TinyNet


def timed_steps(model, opt, steps: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(torch.randn(64, 16, device="cuda")).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


if __name__ == "__main__":
    net = TinyNet().cuda()
    sgd = torch.optim.SGD(net.parameters(), lr=0.01)
    print(f"{timed_steps(net, sgd, 50) * 1e3:.3f} ms per step")
