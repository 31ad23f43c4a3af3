"""A Lightning script with ``ModelParallelStrategy``: the LightningModule holds a Llama (``self.model``)
and shards it with FSDP2 in ``configure_model``; the names the user knows are the LightningModule's
(``model.model.layers.1...``), one level above the sharded root."""

import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.integration.zero_code import common

PLANTED = "model.model.layers.1.mlp.down_proj.weight"


class LanguageModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = common.tiny_llama()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(self.model, mesh=mesh, mp_policy=policy)

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(common.param_groups(self.named_parameters(), PLANTED), lr=common.LR)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(common.token_batches(self.global_rank), batch_size=None)


module = LanguageModel()
trainer = L.Trainer(
    accelerator="cpu",
    devices=common.WORLD,
    strategy=ModelParallelStrategy(data_parallel_size=common.WORLD, tensor_parallel_size=1),
    max_steps=common.STEPS,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    use_distributed_sampler=False,
)
trainer.fit(module)
common.print_losses(dist.get_rank(), module.losses)
# As a script should end: Lightning leaves the process group up. The barrier lets gloo's worker
# threads let go of the trainer's last collectives before the interpreter shuts down, where doing
# so can abort the process (pytorch/pytorch#179291; see test_zero_code.TEARDOWN_ABORT).
dist.barrier()
dist.destroy_process_group()
