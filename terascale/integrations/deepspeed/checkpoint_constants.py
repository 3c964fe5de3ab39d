"""The key names DeepSpeed's checkpoints and universal-checkpoint metadata use.

Megatron-DeepSpeed and similar programs store a ``UNIVERSAL_CHECKPOINT_INFO`` dict in their
checkpoints (``client_state``), keyed by these names, to tell DeepSpeed's offline
conversion which parameters are vocabulary-padded, replicated or row-parallel.
terascale's checkpoints reshard at load with no conversion step, so it reads none of this
metadata; the names exist so that such programs build and save it unchanged (it is kept
in the checkpoint as client state like any other).
"""

from __future__ import annotations

# The state-dict keys of DeepSpeed's checkpoint files.
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
PARAM_GROUPS = "param_groups"
PARTITION_COUNT = "partition_count"
ZERO_STAGE = "zero_stage"
CLIP_GRAD = "clip_grad"
LOSS_SCALER = "loss_scaler"
PARAM = "param"
PARAM_SHAPES = "param_shapes"
BUFFER_NAMES = "buffer_names"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
DS_VERSION = "ds_version"

# Universal-checkpoint metadata (see the module docstring).
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
UNIVERSAL_CHECKPOINT_VERSION_KEY = "universal_checkpoint_version"
UNIVERSAL_CHECKPOINT_VERSION_VALUE = 0.4
VOCAB_TENSOR = "vocab_tensor"
PADDED_VOCAB_SIZE = "padded_vocab_size"
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
CAT_DIM = "cat_dim"
VOCABULARY_PARAMETER_PATTERNS = "vocabulary_parameter_patterns"
PIPELINE_REPLICATED_PARAMETER_PATTERNS = "pipeline_replicated_parameter_patterns"
PARAMETER_TO_AVERAGE_PATTERNS = "parameter_to_average_patterns"
PARAMETER_WITH_ROW_PARALLELISM_PATTERNS = "parameter_with_row_parallelism_patterns"
TP_REPLICATED_PARAMETER_PATTERNS = "tp_replicated_parameter_patterns"
PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0 = "parameter_with_2_sub_params_cat_dim_0"
PARAMETER_WITH_SUB_PARAMS = "parameter_with_sub_params"
SUB_PARAM_SHAPE = "sub_param_shape"

NAMES = sorted(n for n in dir() if n.isupper())
