"""Lightning's own ``DeepSpeedStrategy`` on CPU with terascale standing in for ``deepspeed``:
Lightning refuses the CPU by its own check (``setup_environment``: CUDA only), after its
constructor accepted the stand-in. That is why ``TerascaleStrategy`` stays the CPU path (see the
module docstring of ``terascale.integrations.lightning``); if a Lightning release drops the
check, this test fails and the native path should be tried again (issue 45)."""

from __future__ import annotations

from distributed import run_forked


def _fit_on_cpu(results) -> None:  # type: ignore[no-untyped-def]
    from terascale.integrations.deepspeed import standin

    standin.install()
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, index):  # type: ignore[no-untyped-def]
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(strategy="deepspeed_stage_2", accelerator="cpu", devices=1, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    strategy = type(trainer.strategy).__name__
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    try:
        trainer.fit(Tiny(), DataLoader(data, batch_size=4))
        results.put((strategy, None))
    except RuntimeError as exc:
        results.put((strategy, str(exc)))


def test_lightning_deepspeed_strategy_refuses_the_cpu_itself():
    code, (strategy, error) = run_forked(_fit_on_cpu)
    assert code == 0 and strategy == "DeepSpeedStrategy"
    assert error is not None and "only supported on CUDA GPUs" in error and "CPUAccelerator" in error, error
