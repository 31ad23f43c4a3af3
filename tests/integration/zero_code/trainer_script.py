"""An HF Trainer script with Accelerate's FSDP2: the optimizer built before the model is sharded.

On a CPU machine the Trainer's Accelerator runs DDP; ``create_accelerator_and_postprocess`` puts
it in the FSDP2 state a GPU machine gets (``fsdp_config={"fsdp_version": 2}`` there).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from transformers import Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.integration.zero_code import common

PLANTED = "model.layers.1.mlp.down_proj.weight"


class FSDP2Trainer(Trainer):
    losses: list[float] = []

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator.state.distributed_type = DistributedType.FSDP
        self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            mixed_precision_policy={"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        )
        self.is_fsdp_enabled = True

    def create_optimizer(self, model=None):
        # Built over the unsharded model, as the Trainer does under FSDP2; prepare() swaps in the shards.
        if self.optimizer is None:
            named = (model or self.model).named_parameters()
            self.optimizer = torch.optim.AdamW(common.param_groups(named, PLANTED), lr=common.LR)
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.losses.append(loss.item())
        return loss


class Batches(torch.utils.data.Dataset):
    """This rank's token batches, one sample per item (the Trainer batches them back)."""

    def __init__(self, rank: int) -> None:
        self.rows = [row for batch in common.token_batches(rank) for row in batch]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


args = TrainingArguments(
    output_dir="trainer_output",
    use_cpu=True,
    ddp_backend="gloo",
    per_device_train_batch_size=common.BATCH,
    max_steps=common.STEPS,
    learning_rate=common.LR,
    lr_scheduler_type="constant",
    warmup_steps=0,
    weight_decay=0.0,
    adam_beta1=0.9,
    adam_beta2=0.999,
    adam_epsilon=1e-8,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    logging_strategy="no",
    dataloader_num_workers=0,
    seed=0,
)
rank = dist.get_rank() if dist.is_initialized() else int(__import__("os").environ["RANK"])
trainer = FSDP2Trainer(model=common.tiny_llama(), args=args, train_dataset=Batches(rank))
trainer.train()
common.print_losses(dist.get_rank(), FSDP2Trainer.losses)
# As a script should end: the Trainer leaves the process group up. The barrier lets gloo's worker
# threads let go of the Trainer's last collectives before the interpreter shuts down, where doing
# so can abort the process (pytorch/pytorch#179291; see test_zero_code.TEARDOWN_ABORT).
dist.barrier()
dist.destroy_process_group()
