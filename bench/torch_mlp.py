"""The same MLP training step in PyTorch on the CPU, one thread: steps/s."""
import time

import torch

torch.set_num_threads(1)
for name, dims, batch, steps in [("784-100-10 batch 100", [784, 100, 10], 100, 2000),
                                 ("784-1024-1024-10 batch 256", [784, 1024, 1024, 10], 256, 50)]:
    layers = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.rand(batch, 784)
    y = torch.randint(0, 10, (batch,))
    loss_fn = torch.nn.CrossEntropyLoss()
    t = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    print(f"{name:28s} pytorch {steps / (time.perf_counter() - t):8.1f} steps/s")
