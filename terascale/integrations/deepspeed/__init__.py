"""The DeepSpeed-name compatibility layer: ``import terascale as deepspeed`` runs DeepSpeed
programs (see ``names.py`` for the map and ``docs/deepspeed_names.md`` for what is
provided and what is refused, and why).

One concept per module: ``accelerator`` (``get_accelerator()``), ``params`` (the
``safe_get_full_*`` family), ``zero_to_fp32``, ``ops`` (DeepSpeed's optimizer classes),
``config`` (``DeepSpeedConfig``), ``utils`` (small helpers). The engine's DeepSpeed-named
methods are in ``terascale/engine/deepspeed_api.py``, ``deepspeed.comm``'s functions in
``terascale/comm/api.py``.
"""
