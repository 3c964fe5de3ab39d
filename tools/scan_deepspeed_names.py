"""Count which DeepSpeed names published training code uses, and which terascale provides.

    python tools/scan_deepspeed_names.py SOURCE=PATH ... [--write]
    python tools/scan_deepspeed_names.py --refresh


Each ``SOURCE=PATH`` is a bare git directory (the default branch's ``HEAD`` is read) or
a folder of Python files (an installed package). The scan reads every ``.py`` file whose
code (comments and string literals removed) mentions ``deepspeed``, and counts per name
the files that use it:

- ``deepspeed.a.b`` attribute chains after ``import deepspeed`` (or an alias of it, or of
  a submodule: ``from deepspeed import comm as dist`` makes ``dist.get_rank`` count as
  ``deepspeed.comm.get_rank``), and every ``from deepspeed.a import b``;
- ``get_accelerator().name``, as ``deepspeed.accelerator.get_accelerator().name``;
- the engine's methods and attributes, as ``engine.name``: a name of DeepSpeed's
  ``DeepSpeedEngine`` / ``PipelineEngine`` (``ENGINE_METHODS``, ``ENGINE_ATTRIBUTES``)
  that ``nn.Module`` does not already have. A method counts when called (``.name(``);
  names that other objects also have (``step``, ``backward``, attributes such as
  ``local_rank``, which argparse namespaces hold too) count only on a receiver named like
  an engine (``ENGINE_RECEIVER``);
- DeepSpeed's ZeRO-3 parameter attributes (``p.ds_numel``, ``p.ds_status``, ...), as ``param.name``.

With ``--write`` it resolves every name against terascale
(:func:`terascale.integrations.deepspeed.names.status_of`) and writes
``tests/data/deepspeed_names.json`` and the table in ``docs/deepspeed_names.md``.
``--refresh`` re-resolves the names already in the JSON (after a change to terascale,
without the sources) and rewrites both.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
import tokenize
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# DeepSpeedEngine's and PipelineEngine's public methods (learned from DeepSpeed's engine,
# minus nn.Module's own: forward, train, eval, zero_grad, ...).
ENGINE_METHODS = """
backward step save_checkpoint load_checkpoint train_batch eval_batch is_gradient_accumulation_boundary
set_gradient_accumulation_boundary gradient_accumulation_steps train_batch_size train_micro_batch_size_per_gpu
set_train_batch_size set_train_micro_batch_size zero_optimization zero_optimization_stage
zero_optimization_partition_weights zero_optimization_partition_gradients zero_offload_optimizer
zero_offload_param zero_cpu_offload zero_use_cpu_optimizer fp16_enabled bfloat16_enabled amp_enabled
gradient_clipping get_lr get_mom get_type steps_per_print wall_clock_breakdown optimizer_name optimizer_params
scheduler_name scheduler_params no_sync empty_partition_cache offload_states reload_states compile is_compiled
get_global_grad_norm was_step_applied save_16bit_model save_fp16_model module_state_dict
load_module_state_dict destroy get_batch_info dump_state get_data_parallel_rank get_model_parallel_rank
get_tensor_parallel_rank get_sequence_parallel_group is_first_stage is_last_stage get_pipeline_parallel_rank
set_dataloader set_dataiterator set_batch_fn reset_activation_shape set_has_attention_mask deepspeed_io
allreduce_gradients memory_breakdown zero_grad_hooks communication_data_type dynamic_loss_scale
_zero3_consolidated_16bit_state_dict initial_dynamic_scale zero_gather_16bit_weights_on_model_save loss_scale
sparse_gradients_enabled flops_profiler_enabled zero_allow_untested_optimizer elasticity_enabled
get_wall_clock_timers curriculum_learning_enabled data_efficiency_enabled pld_enabled eigenvalue_enabled
random_ltd_enabled
""".split()
ENGINE_ATTRIBUTES = """
local_rank global_rank world_size dp_world_size mp_world_size global_steps global_samples micro_steps skipped_steps
tput_timer monitor module optimizer lr_scheduler training_dataloader client_optimizer client_lr_scheduler
data_parallel_group mpu timers flops_profiler losses device config num_stages stage_id micro_batches
grid is_pipe_parallel is_data_parallel is_model_parallel agg_train_loss
""".split()
# Names other objects commonly have too: counted only on a receiver named like an engine.
GENERIC = {
    "backward", "step", "save_checkpoint", "load_checkpoint", "get_lr", "get_mom", "get_type", "no_sync",
    "compile", "destroy", "loss_scale", "dump_state", "set_dataloader", "memory_breakdown", "is_compiled",
    "communication_data_type", "zero_grad_hooks", "get_batch_info", "dynamic_loss_scale",
}
# A receiver named like an engine: certainly (attributes) or probably (generic methods:
# ``model.backward(loss)`` is an engine's, a plain module has no ``backward``).
ENGINE_RECEIVER = re.compile(r"(?i)(?:engine|deepspeed|model_wrapped|ds_model)(?:\[[^\]]*\])?$")
MODEL_RECEIVER = re.compile(r"(?i)(?:engine|deepspeed|model_wrapped|^model|_model)(?:\[[^\]]*\])?$")
PARAM_ATTRIBUTES = ("ds_id", "ds_status", "ds_numel", "ds_shape", "ds_tensor", "ds_active_sub_modules", "ds_persist")


def python_files(path: str) -> Iterator[tuple[str, str]]:
    """``(relative path, text)`` of every Python file in a bare git dir's HEAD or a folder."""
    p = Path(path)
    if (p / "HEAD").exists() and (p / "objects").exists():
        git = ["git", f"--git-dir={p}"]
        names = subprocess.run([*git, "ls-tree", "-r", "--name-only", "HEAD"], check=True,
                               capture_output=True, text=True).stdout.split("\n")  # fmt: skip
        for name in names:
            if name.endswith(".py"):
                blob = subprocess.run([*git, "show", f"HEAD:{name}"], capture_output=True)
                yield name, blob.stdout.decode("utf-8", "replace")
        return
    for f in sorted(p.rglob("*.py")):
        yield str(f.relative_to(p)), f.read_text("utf-8", "replace")


def code_only(text: str) -> str:
    """``text`` with comments removed and string literals emptied (names in docstrings
    and messages are not uses). Files tokenize cannot read are kept as they are."""
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                continue
            if tok.type == tokenize.STRING or tok.type in _FSTRING_TOKENS:
                out.append((tok.start, tok.end, '""' if tok.type == tokenize.STRING else ""))
                continue
            out.append((tok.start, tok.end, tok.string))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return text
    return _untokenize(out)


_FSTRING_TOKENS = {getattr(tokenize, n) for n in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END")
                   if hasattr(tokenize, n)}  # fmt: skip


def _untokenize(tokens: list[tuple[tuple[int, int], tuple[int, int], str]]) -> str:
    lines: list[str] = []
    row, col = 1, 0
    for (srow, scol), (erow, ecol), s in tokens:
        if srow > row:
            lines.append("\n" * (srow - row))
            row, col = srow, 0
        if scol > col:
            lines.append(" " * (scol - col))
        lines.append(s)
        row, col = erow, ecol if erow > srow or s else scol
        if "\n" in s:
            row, col = srow + s.count("\n"), 0
    return "".join(lines)


_IMPORT = re.compile(r"^\s*import\s+(deepspeed(?:\.\w+)*)(?:\s+as\s+(\w+))?", re.M)
_FROM = re.compile(r"^\s*from\s+(deepspeed(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n]*(?:\\\n[^\n]*)*)", re.M)
_CHAIN = r"(?<![\w.])%s((?:\.\w+)+)"


def names_in(code: str) -> set[str]:
    """Every DeepSpeed name ``code`` uses (see the module docstring)."""
    found: set[str] = set()
    aliases: dict[str, str] = {}
    for m in _IMPORT.finditer(code):
        module, alias = m.group(1), m.group(2)
        if module != "deepspeed":
            found.add(f"import {module}")
        aliases[alias or "deepspeed"] = module if alias else "deepspeed"
    for m in _FROM.finditer(code):
        module = m.group(1)
        for part in m.group(2).strip("()").replace("\\\n", " ").split(","):
            words = part.split()
            if not words or words[0] == "*":
                continue
            name = words[0]
            found.add(f"{module}.{name}")
            aliases[words[2] if len(words) == 3 and words[1] == "as" else name] = f"{module}.{name}"
    body = _FROM.sub("", _IMPORT.sub("", code))  # uses, not the import statements
    for alias, target in aliases.items():
        for m in re.finditer(_CHAIN % re.escape(alias), body):
            chain = m.group(1)
            if alias == "get_accelerator":
                continue
            found.add(target + chain)
        for m in re.finditer(r"(?<![\w.])%s\(\)\.(\w+)" % re.escape(alias), body):
            found.add(f"{target}().{m.group(1)}")
    found |= engine_names(body)
    found |= {f"param.{a}" for a in PARAM_ATTRIBUTES if re.search(rf"\.{a}\b", code)}
    return {_trim(n) for n in found}


def _trim(name: str) -> str:
    """Drop the attributes of a tensor or object that a chain reaches past a DeepSpeed name
    (``deepspeed.comm.ReduceOp.SUM`` stays; ``deepspeed.__version__.split`` is ``deepspeed.__version__``)."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.startswith("__") and p.endswith("__"):
            return ".".join(parts[: i + 1])
    return name


def engine_names(code: str) -> set[str]:
    out = set()
    for m in re.finditer(r"([\w\]\[]+)\s*\.\s*(\w+)\s*(\()?", code):
        receiver, name, call = m.group(1), m.group(2), m.group(3)
        if name not in ENGINE_METHODS and name not in ENGINE_ATTRIBUTES:
            continue
        if name in ENGINE_METHODS and call and (name not in GENERIC or MODEL_RECEIVER.search(receiver)):
            out.add(f"engine.{name}")
        elif name in ENGINE_ATTRIBUTES and ENGINE_RECEIVER.search(receiver) and not call:
            out.add(f"engine.{name}")
    return out


def describe_source(path: str) -> str:
    """Where a source came from: a repository's commit, or an installed package's version."""
    p = Path(path)
    if (p / "HEAD").exists() and (p / "objects").exists():
        commit = subprocess.run(["git", f"--git-dir={p}", "rev-parse", "HEAD"], capture_output=True, text=True)
        return f"{p.parent.name.replace('+', '/')}@{commit.stdout.strip()[:12]}"
    dist = sorted(p.parent.glob(f"{p.name}-*.dist-info"))
    return dist[-1].name.removesuffix(".dist-info").replace("-", " ", 1) if dist else str(p)


def scan(sources: dict[str, str]) -> dict[str, dict[str, int]]:
    """``{name: {source: files using it}}``."""
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for source, path in sources.items():
        for _, text in python_files(path):
            code = code_only(text)
            if "deepspeed" not in code.lower():
                continue
            for name in names_in(code):
                counts[name][source] += 1
    return counts


def coverage(entries: list[dict]) -> dict[str, float]:
    """Shares of the weighted uses (files per name, summed): provided, refused (of which
    for features terascale does not build yet), missing; and provided among the names
    that are not refused for an unbuilt feature."""
    total = sum(e["files"] for e in entries) or 1
    weight = {k: sum(e["files"] for e in entries if e["status"] == k) for k in ("provided", "refused", "missing")}
    feature = sum(e["files"] for e in entries if e["status"] == "refused" and e["note"].startswith("feature:"))
    return {
        "provided": weight["provided"] / total,
        "refused": weight["refused"] / total,
        "refused_unbuilt_feature": feature / total,
        "missing": weight["missing"] / total,
        "provided_of_built_features": weight["provided"] / max(total - feature, 1),
    }


HEADER = """# DeepSpeed names in published code, and terascale's answer

`import terascale as deepspeed` is meant to run DeepSpeed programs unchanged. This table
counts which DeepSpeed names published code uses and says, for each, what terascale
gives it: **provided** (the terascale object it resolves to) or **refused** (the reason).
A refused function or class that DeepSpeed 0.19.8 has still imports: it is a stand-in that
raises `NotProvidedError` with the reason when it is called or instantiated, and
`isinstance` against it is False (`terascale/integrations/deepspeed/unprovided.py`); a
name DeepSpeed does not have, or a constant, fails at its import (ModuleNotFoundError or
AttributeError, with the reason where there is one). Generated by `tools/scan_deepspeed_names.py` (method in its docstring); the
same data, with per-source counts, is `tests/data/deepspeed_names.json`, and
`tests/test_deepspeed_names.py` resolves every name again and checks the coverage.

**Sources** (every `.py` file whose code mentions `deepspeed`): {sources}.

**How names are counted.** `deepspeed.a.b` attribute chains (through aliases: `from
deepspeed import comm as dist` makes `dist.get_rank` count as `deepspeed.comm.get_rank`),
every `from deepspeed.a import b`, `import deepspeed.a`, `get_accelerator().x` calls, engine
methods and attributes (`engine.x`: DeepSpeed engine names that `nn.Module` lacks; a
method counts when called, names other objects share only on a receiver named like an
engine) and ZeRO-3 parameter attributes (`param.ds_numel`). "Files" is the number of
files using the name; coverage weighs each name by it.

**Coverage** ({names} names, {weight} weighted uses): provided **{provided:.1%}**, refused
{refused:.1%} ({feature:.1%} for DeepSpeed features terascale does not build yet:
inference kernels and their module injection, compression training, random-LTD and data analysis, expert
tensor parallelism, FPDT, DeepCompile, Domino; the rest where terascale works another way on purpose),
missing {missing:.1%}.
Of the uses of features terascale builds, **{built:.1%}** are provided.

| # | DeepSpeed name | files | status | terascale |
| ---: | --- | ---: | --- | --- |
"""


def render_markdown(data: dict, path: Path) -> None:
    entries = data["names"]
    cov = coverage(entries)
    sources = ", ".join(f"{label} ({where})" for label, where in data["sources"].items())
    text = HEADER.format(
        sources=sources, names=len(entries), weight=sum(e["files"] for e in entries), provided=cov["provided"],
        refused=cov["refused"], feature=cov["refused_unbuilt_feature"], missing=cov["missing"],
        built=cov["provided_of_built_features"],
    )  # fmt: skip
    for i, e in enumerate(entries, 1):
        note = e["note"].replace("|", "\\|")
        text += f"| {i} | `{e['name']}` | {e['files']} | {e['status']} | {note} |\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="*", metavar="SOURCE=PATH")
    parser.add_argument("--write", action="store_true", help="write the JSON and the Markdown table")
    parser.add_argument("--refresh", action="store_true", help="re-resolve the names in the JSON; rewrite both")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from terascale.integrations.deepspeed.names import status_of

    json_path = ROOT / "tests/data/deepspeed_names.json"
    if args.refresh:
        data = json.loads(json_path.read_text())
        rows = [(e["name"], e["by_source"]) for e in data["names"]]
        described = data["sources"]
    else:
        if not args.sources:
            parser.error("give SOURCE=PATH arguments, or --refresh")
        sources = dict(s.split("=", 1) for s in args.sources)
        counts = scan(sources)
        rows = sorted(counts.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))
        described = {label: describe_source(path) for label, path in sources.items()}
        if not args.write:
            for name, by in rows:
                print(f"{sum(by.values()):5d}  {name}  {dict(by)}")
            return 0
    entries = []
    for name, by in rows:
        status, note = status_of(name)
        entries.append({"name": name, "files": sum(by.values()), "by_source": dict(by), "status": status, "note": note})
    data = {"sources": described, "names": entries}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(data, indent=1) + "\n")
    render_markdown(data, ROOT / "docs/deepspeed_names.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
