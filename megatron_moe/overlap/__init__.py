"""Lancet (issue 14): weight-gradient GEMMs deferred and run under the backward all-to-alls.

`linears.py`: megatron-core's Column/RowParallelLinear whose weight gradient goes through a store.
"""
