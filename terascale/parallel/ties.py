"""Parameters that several pipeline stages hold copies of (tied layers).

[Note: tied parameters across stages]
A tied layer (the input embedding on the first stage reused as the output head on the
last) is built on every stage that uses it; each copy gets the gradient of its own uses.
Before the optimizer step the copies' gradients are summed over the tie's group, so every
copy takes the same update and the copies stay equal (they start equal: the stage that
owns the tie broadcasts its initial values). The sum is the gradient of the one shared
weight, exactly as on one process. In the global gradient norm and in checkpoints only
the *owner* copy counts (the first stage holding it): counting every copy would count
the weight several times.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed import ProcessGroup


@dataclass(frozen=True, eq=False)
class Tie:
    """This rank's copies of one tied layer's parameters (see [Note: tied parameters across stages]).

    ``params``/``names`` list the copies in the same order on every member of ``group``
    (the ranks holding a copy, with the same data- and tensor-parallel coordinates);
    ``owner`` is True on the first pipeline stage holding it, whose values the others
    take at start and whose copy alone is counted in norms and saved.
    """

    key: str
    names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]
    group: ProcessGroup
    owner: bool
