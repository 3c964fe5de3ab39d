"""Health of a run: a pre-flight check of every rank (``terascale check``) and the monitors
that run during training (collective watchdog, straggler detector, non-finite policy).

Each concept has its own module; import from them directly (``terascale.health.watchdog``,
``terascale.health.preflight``, ...). This package imports nothing eagerly so that the
command line stays fast.
"""
