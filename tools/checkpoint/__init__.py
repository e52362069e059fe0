"""Checkpoint conversion: `python -m tools.checkpoint.convert {reshard,import-hf,export-hf,verify}` (convert.py
the command line, reshard.py and hf.py the commands)."""
