"""The project's command-line tools (data, tokenizer, checkpoints, benchmarks), a package: run each from the
repository root as `python -m tools.NAME` (or `python -m tools.NAME` where this package is installed, `make
install`); a tool imports its siblings as `tools.NAME`."""
