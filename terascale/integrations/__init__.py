"""Thin adapters that let other training frameworks drive a terascale engine.

- :mod:`terascale.integrations.transformers`: the Hugging Face ``Trainer`` (and its
  subclasses: ``Seq2SeqTrainer``, TRL's ``SFTTrainer``, ...) with a DeepSpeed config.
- :mod:`terascale.integrations.lightning`: a Lightning ``Strategy``.
- :mod:`terascale.integrations.peft`: PEFT adapters under ZeRO-3 (adapter-only and
  merged saves).
- :mod:`terascale.integrations.deepspeed`: DeepSpeed's public names on terascale
  (``import terascale as deepspeed``; the map is ``deepspeed/names.py``).

Each imports its framework only when used; the rest of terascale never imports them.
"""
