"""DeepSpeed's ``zero_to_fp32``: the fp32 weights out of a sharded checkpoint, as a function
and as a script.

    python -m terascale.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT [--tag TAG] [--safe_serialization]
    python path/to/this/file.py CHECKPOINT_DIR OUTPUT

``CHECKPOINT_DIR`` is what ``engine.save_checkpoint`` wrote (a save directory with
``latest``, or one checkpoint folder). ``OUTPUT`` ending in ``.bin``/``.pt``/``.pth`` is
written with ``torch.save``, ending in ``.safetensors`` as safetensors; any other path is a
folder that gets ``pytorch_model.bin`` (``model.safetensors`` with
``--safe_serialization``). terascale writes one file however large the model
(``--max_shard_size`` is accepted for DeepSpeed's command lines and splits nothing), and
its safetensors writing streams one parameter at a time
(:func:`terascale.checkpoint.write_consolidated`, also ``terascale consolidate``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn

from terascale.checkpoint import CheckpointDirectory, Manifest, consolidated_state_dict, write_consolidated
from terascale.checkpoint.manifest import CheckpointError


def _frozen(checkpoint_dir: str | os.PathLike, tag: str | None) -> set[str]:
    folder = CheckpointDirectory.find(checkpoint_dir, tag)
    if folder is None:
        raise CheckpointError(f"'{checkpoint_dir}' holds no checkpoint: no manifest.json and no 'latest' file")
    m = Manifest.read(folder)
    frozen = {n for n, info in m.params.items() if info.opt_group < 0}
    return frozen | {a for n in frozen for a in m.aliases.get(n, [])}


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """The model's state dict in fp32 on CPU from a checkpoint saved on any number of ranks
    at any stage (every parameter full, tied ones under each name, buffers included)."""
    state = consolidated_state_dict(checkpoint_dir, tag)
    if exclude_frozen_parameters:
        frozen = _frozen(checkpoint_dir, tag)
        state = {n: t for n, t in state.items() if n not in frozen}
    return state


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    max_shard_size: str = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> Path:
    """Write the fp32 state dict to ``output_dir`` (a file, or a folder; see the module
    docstring); returns the file written."""
    out = Path(output_dir)
    if out.suffix not in (".bin", ".pt", ".pth", ".safetensors"):
        out.mkdir(parents=True, exist_ok=True)
        out = out / ("model.safetensors" if safe_serialization else "pytorch_model.bin")
    if out.suffix == ".safetensors" and not exclude_frozen_parameters:
        write_consolidated(checkpoint_dir, out, tag=tag)  # streamed: one parameter in memory at a time
        return out
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({n: t.contiguous() for n, t in state.items()}, str(out))  # shared (tied) tensors as copies
    else:
        torch.save(state, out)
    return out


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike,
                                         tag: str | None = None) -> nn.Module:  # fmt: skip
    """Load the checkpoint's fp32 weights into ``model`` (moved to the CPU); returns it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="zero_to_fp32", description="Write the fp32 weights of a checkpoint that engine.save_checkpoint wrote."
    )
    parser.add_argument("checkpoint_dir", help="the save directory (with 'latest') or one checkpoint folder")
    parser.add_argument("output", help="a .bin/.pt/.safetensors file, or a folder")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the 'latest' file's)")
    parser.add_argument("--safe_serialization", action="store_true", help="write model.safetensors into a folder")
    parser.add_argument("--max_shard_size", default="5GB", help="accepted; terascale writes one file")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted (DeepSpeed's flag)")
    args = parser.parse_args(argv)
    try:
        out = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir, args.output, args.max_shard_size, args.safe_serialization, args.tag,
            args.exclude_frozen_parameters,
        )  # fmt: skip
    except CheckpointError as err:
        print(f"zero_to_fp32: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
