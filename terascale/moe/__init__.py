"""Mixture of experts: routing tokens to experts (``gating``) and moving them to the ranks
that hold their experts and back (``dispatch``)."""
