"""Tensor parallelism: layers whose weights are split over a tensor-parallel process group.

Megatron's scheme. Column- and row-parallel linear layers pair up so that a transformer
block's attention and MLP each cost one all-reduce in forward and one in backward
(``collectives``, [Note: regions]); a vocabulary-parallel embedding and cross-entropy keep
the largest matrices split; sequence parallelism splits the activations between blocks
along the sequence and turns those all-reduces into all-gathers and reduce-scatters
(``norm``, [Note: sequence-parallel parameters]); dropout draws per-rank or shared masks
as the activations are sliced or replicated (``dropout``). ``parallelize_module`` swaps a
model's layers by a plan of name patterns, and ``auto_tp`` does so for Hugging Face
Llama, Mistral, Qwen2 and GPT-2 models. Every layer keeps the unsliced module's parameter
names and describes its slices through ``tensor_parallel_slices()``, which
``terascale.parallel.slicing.sliced_parameters`` collects for checkpoints.

Process groups are always passed in explicitly (``Topology.group("tp")``); nothing here
reads global state, and the same code runs over gloo on CPU and NCCL on GPUs.

[Note: why plain tensors]
torch has its own tensor parallelism: ``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel`` (``torch.distributed.tensor.parallel``). It replaces each weight by
``nn.Parameter(DTensor)``, a tensor subclass that carries its mesh and placement and
dispatches every op through DTensor's sharding propagation, and its gradients are
DTensors as well. terascale's ZeRO (DESIGN.md, "Groups of flat shards") keeps every
parameter a plain tensor whose ``.data`` is a view into its group's flat buffer, and
frees/regathers that buffer's storage. Checked with torch 2.13 on gloo: assigning a plain
view to a DTensor parameter's ``.data`` is accepted but the DTensor's local tensor does
not become that view (writes to the flat buffer are not seen by the layer), and the
gradients arrive as DTensors that the flat gradient buffers cannot hold. Making the two
fit would mean teaching ZeRO, the checkpoint code and the optimizers about DTensor (what
FSDP2 does, a different design). So these layers hold plain local tensors - exactly the
slice a rank owns, under the unsliced name - put their communication in a few explicit
autograd functions, and describe their slicing in plain data (``TensorSlice``) that the
checkpoint code reads. To ZeRO a tensor-parallel layer is just a module with smaller
parameters.
"""

from terascale.parallel.tensor.auto_tp import SUPPORTED as AUTO_TP_MODEL_TYPES
from terascale.parallel.tensor.auto_tp import auto_tp
from terascale.parallel.tensor.collectives import (
    SEQUENCE_DIM,
    copy_to_tensor_region,
    gather_from_sequence_region,
    gather_from_tensor_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tensor_region,
)
from terascale.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from terascale.parallel.tensor.dropout import ParallelDropout, parallel_dropout
from terascale.parallel.tensor.embedding import VocabParallelEmbedding
from terascale.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear
from terascale.parallel.tensor.norm import SequenceParallelNorm
from terascale.parallel.tensor.parallelize import (
    Colwise,
    ParallelStyle,
    Rowwise,
    SequenceParallel,
    VocabParallel,
    parallelize_module,
)

__all__ = [
    "AUTO_TP_MODEL_TYPES",
    "SEQUENCE_DIM",
    "ColumnParallelLinear",
    "Colwise",
    "ParallelDropout",
    "ParallelStyle",
    "RowParallelLinear",
    "Rowwise",
    "SequenceParallel",
    "SequenceParallelNorm",
    "VocabParallel",
    "VocabParallelEmbedding",
    "auto_tp",
    "copy_to_tensor_region",
    "gather_from_sequence_region",
    "gather_from_tensor_region",
    "parallel_dropout",
    "parallelize_module",
    "reduce_from_tensor_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_sequence_region",
    "scatter_to_tensor_region",
    "vocab_parallel_cross_entropy",
]
