"""A Lightning module for SimCLR with torch-contrastive's NT-Xent (``gather=True`` makes the
loss global under Lightning's DDP strategy; one process here).

    python examples/lightning_simclr.py --steps 30
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import torch_contrastive as tc


def _views(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return x + 0.1 * torch.randn(x.shape, generator=gen)


def make_module(dim: int = 16):
    import lightning as L

    class SimCLR(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 32))
            self.loss = tc.NTXentLoss(0.2, pairing="halves", gather=True)
            self.gen = torch.Generator().manual_seed(0)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            (x,) = batch
            z = self.encoder(torch.cat([_views(x, self.gen), _views(x, self.gen)]))
            loss = self.loss(z)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=3e-3)

    return SimCLR()


def run(steps: int = 30, seed: int = 0) -> dict[str, float]:
    """Train ``steps`` steps on 32 clusters of points; returns the loss on a held batch before and after."""
    import lightning as L

    torch.manual_seed(seed)
    centres = torch.randn(32, 16)
    data = centres[torch.randint(0, 32, (steps * 64,))] + 0.05 * torch.randn(steps * 64, 16)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=64)
    module = make_module()
    held = centres + 0.05 * torch.randn(32, 16)
    gen = torch.Generator().manual_seed(1)
    pair = torch.cat([_views(held, gen), _views(held, gen)])

    def held_loss() -> float:
        with torch.no_grad():
            return float(tc.nt_xent_loss(module.encoder(pair), 0.2, pairing="halves"))

    before = held_loss()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    return {"held_loss_before": before, "held_loss_after": held_loss()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    print(run(parser.parse_args().steps))
