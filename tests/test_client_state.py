"""Checkpoints hold data, not code: ``client_state`` is JSON plus safetensors, never a pickle.

Round trips of every type a client state may hold (in process), then through the engine on
real ranks: the files a save writes, a value that is not data refused at the call with its
place named and nothing written, a checkpoint whose old pickled client state would run code
refused (the code does not run) unless the caller opts in (then it does: the test can
fail), auto_resume not reading it at all, and a save + load that never calls pickle.
"""

from __future__ import annotations

import argparse
import enum
import json
import math
import os
import pickle
import random
from collections import Counter, OrderedDict, defaultdict, namedtuple
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from distributed import run_ranks
from terascale.checkpoint import client_state as cs
from terascale.checkpoint.manifest import CheckpointError

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.complex64, torch.uint32]  # fmt: skip


class _Level(enum.IntEnum):
    HIGH = 2


class _Mode(str, enum.Enum):
    FAST = "fast"


def _rich_state() -> dict:
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(3, generator=g)
    return {
        "none": None, "flag": True, "step": 7, "big": 2**70, "name": "run", "lr": 0.1, "neg0": -0.0,
        "nan": math.nan, "inf": math.inf, "ninf": -math.inf, "cx": 1.5 - 2j,
        "pair": (1, ("a", 2.5)), "empty": (), "lst": [1, [2, []]], "set": {1, 2}, "fset": frozenset({"x"}),
        "raw": b"\x00\xffz", "buf": bytearray(b"ab"),
        # optimizer-style int keys, mixed keys, keys that JSON objects cannot hold
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2)}, 1: {}},
        "keys": {None: 0, True: 1, 2.5: 2, (1, "b"): 3, -4: 4},
        "tagged": {"__ts__": "tuple", "items": [1, 2]},  # a user dict with the tag key itself
        "tag_nested": {cs.TAG: {cs.TAG: "float", "value": "nan"}, 5: cs.TAG},
        "ordered": OrderedDict([("b", 1), ("a", 2)]), "counts": Counter("abca"),
        "numpy_rng": np.random.RandomState(3).get_state(), "python_rng": random.Random(4).getstate(),
        "np_scalars": [np.float32(0.1), np.float16(1.5), np.int64(-3), np.uint32(7), np.bool_(True), np.complex64(1j)],
        "arrays": [np.arange(6, dtype=np.uint32).reshape(2, 3), np.array([1.5, -2], dtype=">f8"),
                   np.zeros((0, 2), np.int16), np.array([True, False])],
        "args": argparse.Namespace(lr=0.01, layers=[4, 4], dtype=torch.bfloat16, nested=argparse.Namespace(a=1)),
        "size": torch.Size([2, 3]), "dtype": torch.float16, "device": torch.device("cpu"),
        "tensors": [torch.randn(2, 3, generator=g).to(d) if d.is_floating_point or d.is_complex
                    else torch.randint(0, 2 if d == torch.bool else 100, (2, 3), generator=g).to(d) for d in _DTYPES],
        "views": [torch.arange(12.0).view(3, 4).t(), torch.arange(10)[2:5], torch.tensor(5), torch.empty(0, 4)],
        "grad": torch.nn.Parameter(torch.ones(2)),
        "same": [shared, shared],
    }  # fmt: skip


def _same(a, b, where: str = "") -> None:
    """Equal values of the same types, all the way down (NaN equals NaN; tensors come back
    as plain CPU tensors with the same bits)."""
    if isinstance(a, torch.Tensor):
        assert type(b) is torch.Tensor and b.device.type == "cpu" and not b.requires_grad, where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(_bits(a), _bits(b)), where
        return
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, np.ndarray):
        assert a.dtype.newbyteorder("=") == b.dtype and a.shape == b.shape and (a == b).all(), where
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, argparse.Namespace):
        _same(vars(a), vars(b), where)
    else:
        assert a == b, where
        if isinstance(a, float):
            assert math.copysign(1, a) == math.copysign(1, b), where


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _write(folder: Path, state: dict) -> list:
    folder.mkdir(parents=True, exist_ok=True)
    files = cs.to_files(state)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return cs.manifest_entries(files)


def test_every_supported_type_round_trips(tmp_path) -> None:
    state = _rich_state()
    recorded = _write(tmp_path, state)
    assert sorted(e.name for e in recorded) == sorted(cs.FILES)
    back = cs.read(tmp_path, recorded)
    _same(state, back)
    # What comes back where the type is not kept, and what is kept as one object.
    assert back["same"][0] is back["same"][1]
    assert type(back["grad"]) is torch.Tensor and not back["grad"].requires_grad
    assert type(back["tagged"]) is dict and back["tagged"] == {"__ts__": "tuple", "items": [1, 2]}
    assert back["tag_nested"] == {cs.TAG: {cs.TAG: "float", "value": "nan"}, 5: cs.TAG}
    # The RNG states are usable as they are.
    rs = np.random.RandomState()
    rs.set_state(back["numpy_rng"])
    assert rs.randint(1 << 30) == np.random.RandomState(3).randint(1 << 30)
    r = random.Random()
    r.setstate(back["python_rng"])
    assert r.random() == random.Random(4).random()
    # Strict JSON: no NaN literals, every non-native value tagged.
    json.loads((tmp_path / cs.STATE_FILE).read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))


def test_subclasses_come_back_as_their_plain_kind() -> None:
    default = defaultdict(list, {"k": [1]})

    class Attrs(dict):
        pass

    class Items(list):
        pass

    state = {"dd": default, "attrs": Attrs(a=1), "items": Items([1]), "level": _Level.HIGH, "mode": _Mode.FAST,
             "np_str": np.str_("s"), 5: "int key at the top"}  # fmt: skip
    text, tensors = cs.encode(state)
    back = cs.decode(text, tensors)
    assert back == {"dd": {"k": [1]}, "attrs": {"a": 1}, "items": [1], "level": 2, "mode": "fast", "np_str": "s",
                    5: "int key at the top"}  # fmt: skip
    assert [type(back[k]) for k in ("dd", "attrs", "items", "level", "mode", "np_str")] == [dict, dict, list, int, str, str]


def test_the_saved_copy_is_taken_at_the_call() -> None:
    t, a = torch.zeros(3), np.zeros(2)
    state = {"t": t, "a": a, "d": {"x": 1}}
    files = cs.to_files(state)
    t.add_(1), a.fill(1), state["d"].update(x=2)
    back = cs.decode(files[cs.STATE_FILE].decode(), safetensors.torch.load(files[cs.TENSOR_FILE]))
    assert back["t"].sum() == 0 and back["a"].sum() == 0 and back["d"] == {"x": 1}
    assert cs.TENSOR_FILE not in cs.to_files({"only": "text"})


class _Foo:
    pass


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"sampler": argparse.Namespace(rng=_Foo())},
         "client_state['sampler'].rng: type test_client_state._Foo cannot be saved as data; store its state_dict() or plain values"),
        ({"x": [1, {2: (3, _Foo)}]}, "client_state['x'][1][2][1]: type type cannot be saved as data"),
        ({"fn": len}, "client_state['fn']: type builtin_function_or_method cannot be saved"),
        ({"e": enum.Enum("Color", "RED").RED}, "client_state['e']: type test_client_state.Color cannot be saved as data; store its .value"),
        ({"p": namedtuple("Point", "x y")(1, 2)}, "store v._asdict() or a plain tuple"),
        ({"o": np.array(["a", 1], dtype=object)}, "client_state['o']: a numpy array of dtype object cannot be saved"),
        ({"c": np.zeros(2, np.complex128)}, "client_state['c']: a numpy array of dtype complex128"),
        ({"s": torch.zeros(3).to_sparse()}, "client_state['s']: a torch.sparse_coo tensor cannot be saved as data"),
        ({"q": torch.zeros(2, dtype=torch.complex128)}, "client_state['q']: a tensor of dtype torch.complex128 cannot be saved"),
        ({"k": {torch.zeros(1): 1}}, "client_state['k'] (the key tensor([0.]))"),
        ({"m": torch.zeros(2, device="meta")}, "client_state['m']: a tensor on the meta device"),
        ([("not", "a dict")], "client_state must be a dict, got list"),
    ],
)  # fmt: skip
def test_what_is_not_data_is_refused_naming_its_place(state, message) -> None:
    with pytest.raises(ValueError) as info:
        cs.to_files(state)
    assert message in str(info.value)


def test_a_cycle_is_refused() -> None:
    loop: list = []
    loop.append(loop)
    with pytest.raises(ValueError, match=r"client_state\['l'\]\[0\]: refers to a container it is inside"):
        cs.to_files({"l": loop})


@pytest.mark.parametrize(
    "doc",
    [
        {"__ts__": "os.system", "args": ["touch x"]},  # a name is never imported
        {"__ts__": "tensor", "name": "t9"},
        {"__ts__": "torch.dtype", "name": "manual_seed"},
        {"__ts__": "numpy", "dtype": "object", "value": 1},
        {"__ts__": "dict", "items": [[[1], 2]]},  # an unhashable key
    ],
)
def test_a_malformed_document_is_a_checkpoint_error(doc) -> None:
    text = json.dumps({"format": cs.FORMAT, "version": cs.VERSION, "state": {"x": doc}})
    with pytest.raises(CheckpointError):
        cs.decode(text, {})


def test_a_damaged_file_is_named(tmp_path) -> None:
    recorded = _write(tmp_path, {"t": torch.ones(4)})
    tensors = tmp_path / cs.TENSOR_FILE
    data = tensors.read_bytes()
    tensors.write_bytes(data[:-4] + b"\x00\x00\x80\x7f")  # same size, one value changed
    with pytest.raises(CheckpointError, match="client_state.safetensors' is corrupted"):
        cs.read(tmp_path, recorded)
    tensors.write_bytes(data[:-1])
    entry = next(e for e in recorded if e.name == cs.TENSOR_FILE)
    assert cs.file_problem(tmp_path, entry).endswith(f"has {len(data) - 1} bytes, the manifest records {len(data)}")
    tensors.unlink()
    with pytest.raises(CheckpointError, match="client_state.safetensors' is missing"):
        cs.read(tmp_path, recorded)


# -- through the engine, on real ranks -------------------------------------------------------------


def _config(**checkpoint) -> dict:
    return {
        "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2},
        "checkpoint": checkpoint,
    }


def _engine(**checkpoint):
    import terascale
    from toy import make_model

    engine, *_ = terascale.initialize(model=make_model(), config=_config(**checkpoint))
    return engine


def _step(engine) -> None:
    from toy import make_data

    world, rank = engine.world_size, engine.dist.dp_rank
    x, y = make_data(1, 4)
    micro = 4 // world
    engine.backward(engine(x[0, rank * micro : (rank + 1) * micro], y[0, rank * micro : (rank + 1) * micro]))
    engine.step()


class _Touch:
    """Pickles as a call of ``Path.touch``: unpickling it creates ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def _engine_rank(folder: str) -> dict:
    from terascale.checkpoint.directory import verify

    out: dict = {}
    root = Path(folder)
    engine = _engine()
    _step(engine)
    state = _rich_state()
    engine.save_checkpoint(root / "ok", tag="a", client_state=state)
    out["files"] = sorted(p.name for p in (root / "ok/a").iterdir())
    path, back = engine.load_checkpoint(root / "ok")
    _same(state, back)
    out["verify"] = verify(root / "ok/a", content=True)

    # Not data: refused at the call, naming the place; the earlier checkpoint and latest stay.
    _step(engine)
    with pytest.raises(ValueError) as info:
        engine.save_checkpoint(root / "ok", tag="b", client_state={"sampler": argparse.Namespace(rng=_Foo())})
    out["refused"] = str(info.value)
    out["after_refusal"] = sorted(p.name for p in (root / "ok").iterdir() if not p.name.startswith(".lease"))
    out["latest"] = (root / "ok/latest").read_text()
    # An asynchronous save refuses at the call too, and keeps the values of the call.
    twin = _engine(**{"async": True})
    with pytest.raises(ValueError, match=r"client_state\['f'\]: type function"):
        twin.save_checkpoint(root / "async", tag="x", client_state={"f": lambda: 0})
    value = torch.ones(2)
    twin.save_checkpoint(root / "async", tag="x", client_state={"v": value})
    value.add_(1)  # while the background thread may still be writing
    twin.wait_for_checkpoint()
    out["async"] = twin.load_checkpoint(root / "async")[1]["v"].tolist()
    twin.destroy()

    # A damaged client-state file: verify and load name it, as for a shard file.
    tensors = root / "ok/a" / cs.TENSOR_FILE
    data = tensors.read_bytes()
    tensors.write_bytes(data[:-8] + b"\xff" * 8)
    out["verify_corrupt"] = verify(root / "ok/a", content=True)
    with pytest.raises(CheckpointError) as info:
        engine.load_checkpoint(root / "ok")
    out["load_corrupt"] = str(info.value)
    (root / "ok/a" / cs.STATE_FILE).unlink()
    out["verify_missing"] = verify(root / "ok/a")
    engine.destroy()
    return out


def test_engine_saves_client_state_as_data_and_refuses_what_is_not(tmp_path) -> None:
    (out,) = run_ranks(_engine_rank, 1, str(tmp_path))
    assert out["files"] == ["client_state.json", "client_state.safetensors", "manifest.json", "rank00000-of-00001.safetensors"]
    assert out["verify"] is None
    assert out["refused"] == ("client_state['sampler'].rng: type test_client_state._Foo cannot be saved as data; "
                              "store its state_dict() or plain values")  # fmt: skip
    assert out["after_refusal"] == ["a", "latest"] and out["latest"] == "a"
    assert out["async"] == [1.0, 1.0]
    assert "client_state.safetensors' is corrupted" in out["verify_corrupt"]
    assert "client_state.safetensors' is corrupted" in out["load_corrupt"]
    assert "client_state.json' is missing" in out["verify_missing"]


def _pickled_rank(folder: str, marker: str) -> dict:
    out: dict = {}
    root = Path(folder)
    engine = _engine()
    _step(engine)
    engine.save_checkpoint(root, tag="old")  # no client state; then an old-style pickled one
    torch.save({"step": 3, "payload": _Touch(marker)}, root / "old" / cs.PICKLED_FILE)
    steps = engine.global_steps
    engine.destroy()

    fresh = _engine()
    with pytest.raises(CheckpointError) as info:
        fresh.load_checkpoint(root)
    out["refused"] = str(info.value)
    out["marker_after_refusal"] = os.path.exists(marker)
    out["untouched"] = fresh.global_steps == 0  # refused before anything was loaded
    fresh.destroy()

    # auto_resume does not read the client state at all: it resumes, and nothing runs.
    resumed = _engine(save_dir=str(root), auto_resume=True)
    out["auto_resumed"] = resumed.global_steps == steps
    out["marker_after_auto_resume"] = os.path.exists(marker)
    resumed.destroy()

    trusting = _engine()
    _, client = trusting.load_checkpoint(root, allow_pickled_client_state=True)
    out["opted_in"] = client
    out["marker_after_opt_in"] = os.path.exists(marker)
    trusting.destroy()
    os.remove(marker)
    by_config = _engine(allow_pickled_client_state=True)
    by_config.load_checkpoint(root)
    out["marker_by_config"] = os.path.exists(marker)
    by_config.destroy()
    return out


def test_a_pickled_client_state_runs_nothing_unless_trusted(tmp_path) -> None:
    marker = tmp_path / "code_ran"
    (out,) = run_ranks(_pickled_rank, 1, str(tmp_path / "ckpt"), str(marker))
    msg = out["refused"]
    assert "client_state.pt" in msg and "pickled client state can run arbitrary code when loaded" in msg
    assert "pass allow_pickled_client_state=True to engine.load_checkpoint" in msg
    assert "checkpoint.allow_pickled_client_state" in msg and "only for a checkpoint you trust" in msg
    assert out["marker_after_refusal"] is False and out["untouched"]
    assert out["auto_resumed"] and out["marker_after_auto_resume"] is False
    # The opt-in loads it, and the pickle's code does run: the refusal above is what kept it out.
    assert out["opted_in"] == {"step": 3, "payload": None}
    assert out["marker_after_opt_in"] is True and out["marker_by_config"] is True


def _no_pickle_rank(folder: str) -> dict:
    import _pickle

    def forbidden(*args, **kwargs):
        raise AssertionError("pickle called")

    engine = _engine()
    _step(engine)
    state = {"epoch": 2, "rng": np.random.get_state(), "py": random.getstate(), "t": torch.arange(4)}
    patches = [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (pickle, "dump"), (pickle, "dumps"),
               (pickle, "Pickler"), (_pickle, "load"), (_pickle, "loads"), (torch, "load"), (torch, "save"),
               (torch.serialization, "load"), (torch.serialization, "save")]  # fmt: skip
    saved = [(m, n, getattr(m, n)) for m, n in patches]
    for module, name, _ in saved:
        setattr(module, name, forbidden)
    try:
        engine.save_checkpoint(folder, tag="t", client_state=state)
        _, back = engine.load_checkpoint(folder)
        # The patches catch what they should: an old pickled client state now fails in them.
        Path(folder, "t", cs.PICKLED_FILE).write_bytes(b"not read")
        for name in cs.FILES:
            Path(folder, "t", name).unlink()
        manifest = json.loads(Path(folder, "t", "manifest.json").read_text())
        manifest["client_state"] = []
        Path(folder, "t", "manifest.json").write_text(json.dumps(manifest))
        try:
            engine.load_checkpoint(folder, allow_pickled_client_state=True)
            caught = False
        except AssertionError as exc:
            caught = str(exc) == "pickle called"
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
    engine.destroy()
    return {"same": (back["epoch"], back["t"].tolist()), "rng": back["rng"][1].tolist() == state["rng"][1].tolist(),
            "caught": caught}  # fmt: skip


def test_save_and_load_never_call_pickle(tmp_path) -> None:
    (out,) = run_ranks(_no_pickle_rank, 1, str(tmp_path))
    assert out == {"same": (2, [0, 1, 2, 3]), "rng": True, "caught": True}


def _two_rank(folder: str) -> dict:
    engine = _engine()
    rank = engine.global_rank
    _step(engine)
    bad = {"model": torch.nn.Linear(2, 2)} if rank == 0 else {"fine": 1}
    try:
        engine.save_checkpoint(folder, tag="bad", client_state=bad)
        refused = None
    except ValueError as exc:
        refused = (type(exc).__name__, str(exc))
    # Only rank 0's client state is saved; every rank gets it back.
    engine.save_checkpoint(folder, tag="good", client_state={"rank": rank, "t": torch.full((2,), float(rank))})
    _, back = engine.load_checkpoint(folder)
    engine.destroy()
    dirs = sorted(n for n in os.listdir(folder) if not n.startswith(".lease"))  # the directory's lease: another part
    return {"refused": refused, "back": (back["rank"], back["t"].tolist()), "dirs": dirs}


def test_two_ranks_agree_on_a_refusal_and_read_rank_zeros_state(tmp_path) -> None:
    r0, r1 = run_ranks(_two_rank, 2, str(tmp_path))
    where = "client_state['model']: type torch.nn.modules.linear.Linear cannot be saved as data"
    assert r0["refused"][0] == "ValueError" and r0["refused"][1].startswith(where)
    assert r1["refused"][0] == "CheckpointError" and where in r1["refused"][1]  # not left in a collective
    assert r0["back"] == r1["back"] == (0, [0.0, 0.0])
    assert r0["dirs"] == ["good", "latest"]


def _lightning_rank(out: str) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from torch import nn

    from terascale.checkpoint import Manifest
    from terascale.integrations.lightning import TerascaleStrategy

    class Net(pl.LightningModule):
        def __init__(self, args: argparse.Namespace, layers: tuple = (4, 1), lr: float = 0.05) -> None:
            super().__init__()
            self.save_hyperparameters()  # hyper_parameters: a Namespace, a tuple, a float
            torch.manual_seed(0)
            self.net = nn.Linear(*layers)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.net(batch[0]).square().mean())

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2)}

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)

    def fit(epochs: int, ckpt: str | None = None) -> pl.Trainer:
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy=TerascaleStrategy(config={"zero_optimization": {"stage": 2}}),
            max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, default_root_dir=out,
            callbacks=[ModelCheckpoint(dirpath=f"{out}/best", monitor="val_loss"), EarlyStopping("val_loss", patience=5)],
        )  # fmt: skip
        trainer.fit(Net(argparse.Namespace(seed=1, name="demo")), train_dataloaders=data, val_dataloaders=data,
                    ckpt_path=ckpt)  # fmt: skip
        return trainer

    first = fit(1)
    first.save_checkpoint(f"{out}/ckpt")
    resumed = fit(2, ckpt=f"{out}/ckpt")
    folder = Path(out, "ckpt", "checkpoint")
    client = cs.read(folder, Manifest.read(folder).client_files)
    callbacks = {k.split("{")[0]: v for k, v in client["callbacks"].items()}
    return {
        "steps": (first.global_step, resumed.global_step),
        "files": sorted(p.name for p in folder.iterdir()),
        "hparams": client["hyper_parameters"],
        "best_score": callbacks["ModelCheckpoint"]["best_model_score"],
        "pickles": [str(p) for p in Path(out).rglob(cs.PICKLED_FILE)],
    }


def test_lightning_fit_save_and_resume_with_hyperparameters_and_callbacks(tmp_path) -> None:
    pytest.importorskip("lightning")
    (r,) = run_ranks(_lightning_rank, 1, str(tmp_path), timeout=300)
    assert r["steps"] == (4, 8)  # resumed at step 4, then one more epoch
    assert "client_state.json" in r["files"] and "client_state.safetensors" in r["files"] and r["pickles"] == []
    assert r["hparams"] == {"args": argparse.Namespace(seed=1, name="demo"), "layers": (4, 1), "lr": 0.05}
    assert isinstance(r["best_score"], torch.Tensor)
