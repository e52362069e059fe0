"""Lancet: weight-gradient GEMMs deferred and run under the backward all-to-alls (issue 14)."""
