"""Live elasticity: membership epochs, in-memory mirrors, resizes in the running processes.

* :mod:`~terascale.elastic.membership`: who trains, as epochs on the job's c10d store
  ([Note: membership epochs]);
* :mod:`~terascale.elastic.world`: the default process group of an epoch;
* :mod:`~terascale.elastic.gate`: collectives after a fault ([Note: collectives after a fault]);
* :mod:`~terascale.elastic.spans`: a rank's state as packed spans, and moving them
  ([Note: state moves as spans]);
* :mod:`~terascale.elastic.mirror`: each rank's state in a peer's memory ([Note: in-memory redundancy]);
* :mod:`~terascale.elastic.agent`: the per-node agent of ``terascale run --nnodes MIN:MAX``
  ([Note: the live elastic agent]).

The engine's side (resizing its state in place) is :mod:`terascale.engine.live`. This
package imports nothing from the engine.
"""
