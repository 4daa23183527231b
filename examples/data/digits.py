"""scikit-learn's bundled 8x8 handwritten digits (1797 images, no download) as a LightningDataModule."""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["DigitsDataModule"]


class DigitsDataModule(pl.LightningDataModule):
    """64 features scaled to [0, 1], 10 classes, a fixed stratified train/val split.

    Args:
        val_fraction: share of the images held out for validation.
        split_seed: seed of the (stratified) split; fixed so every rank and every run agree.
        batch_size: images per batch *per DP rank*.
        num_workers: DataLoader workers.
    """

    def __init__(self, val_fraction: float = 0.2, split_seed: int = 0, batch_size: int = 64, num_workers: int = 0):
        super().__init__()
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.train_set: Optional[TensorDataset] = None
        self.val_set: Optional[TensorDataset] = None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        x = (x / 16.0).astype(np.float32)
        x_tr, x_va, y_tr, y_va = train_test_split(
            x, y, test_size=self.val_fraction, random_state=self.split_seed, stratify=y
        )
        self.train_set = TensorDataset(torch.from_numpy(x_tr), torch.from_numpy(y_tr).long())
        self.val_set = TensorDataset(torch.from_numpy(x_va), torch.from_numpy(y_va).long())

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True, num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        """The held-out split again (there is no third split): what ``test=true`` and examples/eval.py report."""
        return self.val_dataloader()
